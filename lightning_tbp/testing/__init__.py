"""Models and inputs for the tests and the benchmarks (small configs of diffusers architectures,
with their own random weights: nothing is downloaded)."""
