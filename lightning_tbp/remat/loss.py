"""The loss a training step computes from the module's outputs, which no trace of the module sees.

It runs after the forward, while everything the forward kept is still held, so on a model whose
outputs are a sizeable share of its step it decides the peak (``docs/design.md``, "The loss").
A metered step measures the real one (``verify.StepMeter``); until then a plan assumes the loss
of diffusion training: the mean squared error of the first output, in float, to a target of its
shape, per sample and then over the batch, as ``DiffusionModule`` computes it. Assumed, but
measured: that loss is run once on stand-ins of the output (``Trace.output_specs``) under the exact
allocator meter, by the plan, above the trace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_tbp.memory.meters import allocator_peak, garbage_collection_held
from lightning_tbp.remat.calibrate import TensorSpec
from lightning_tbp.remat.verify import can_meter


def assumed_loss_bytes(outputs: list[TensorSpec]) -> int:
    """Peak of the assumed loss of ``outputs`` above them, its output gradient included (0 when
    no output needs a gradient, or a running profiler keeps the CPU meter off)."""
    first = next((o for o in outputs if o.needs_grad and o.dtype.is_floating_point), None)
    if first is None or not can_meter(first.device):
        return 0
    devices = [first.device.index or 0] if first.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # stand-in values must not shift the run's random stream
        prediction = first.materialise()
        target = TensorSpec(first.shape, first.stride, torch.float32, first.device).materialise()
    with garbage_collection_held(), allocator_peak(first.device) as reading:
        squared_error = F.mse_loss(prediction.float(), target, reduction="none")
        sample_means = squared_error.flatten(1).mean(dim=1) if squared_error.dim() > 1 else squared_error
        del squared_error
        torch.autograd.backward(sample_means.mean())  # not Tensor.backward, which the user's code may watch
        del sample_means
    return reading.peak_bytes
