"""The CUDA math libraries' workspaces, made before anything on the device is measured.

cuBLAS gives every thread that runs matmuls a handle with its own workspace, allocated through
the caching allocator on the thread's first matmul and kept for the life of the process. A
training step runs matmuls on two threads: the caller's (the forward) and autograd's device
thread (the backward). On an H100 with torch 2.11 that was 33 MiB per thread, 66 MiB in all
(``docs/benchmarks/gpu_h100/peak_breakdown.json``). Made inside a planned or metered step, they
count as the step's own bytes although they are never freed: the first measured step of a tiny
model on CUDA read 1.6x its prediction. Made here, before planning, they are held bytes, like
the parameters.

Lightning's CUDA accelerator frees them when a fit ends (``teardown`` clears cuBLAS's workspaces
and the cache), so a second fit in the same process makes them again: they are warmed at every
fit's set-up and every new plan, never remembered as made (an H200 read a second fit's first
step at 1.7x its prediction when they were).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_tbp.compat import clear_cublas_workspaces


def warm_library_workspaces(device: torch.device) -> None:
    """Run a small forward and backward of a linear layer on ``device`` in float32 and bfloat16
    (cuBLAS and cuBLASLt paths, on the caller's thread and autograd's): where the workspaces exist
    this allocates nothing that stays. Off CUDA it does nothing: CPU kernels keep no workspace
    between calls."""
    if device.type != "cuda":
        return
    with torch.enable_grad():
        for dtype in (torch.float32, torch.bfloat16):
            weight = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
            bias = torch.zeros(16, device=device, dtype=dtype, requires_grad=True)
            torch.autograd.backward(F.linear(weight, weight, bias).float().sum())
    torch.cuda.synchronize(device)


def free_library_workspaces(device: torch.device) -> None:
    """Free cuBLAS's workspaces (every device's) and return the cache, so that what comes next
    makes them again as a fresh process would: a whole fit measured after other work in the same
    process otherwise reads them as already held (``benchmarks/estimate_check.py`` read 1.5x on
    an H200 where a fresh process read 1.00). Off CUDA it does nothing."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    clear_cublas_workspaces()
    torch.cuda.empty_cache()
