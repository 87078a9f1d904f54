"""Fused kernels for per-sample norms (Triton; imported only where Triton is available)."""
