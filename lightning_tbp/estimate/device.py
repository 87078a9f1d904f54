"""The device an estimate is for: how its allocator counts bytes and what its ops cost.

The estimate traces on fake CPU tensors (a CPU build of torch cannot even fake every CUDA op),
so what differs on the target device is modelled here, and nothing else:

* **Allocator rounding.** CUDA's caching allocator hands out blocks in multiples of 512 bytes;
  ``torch.cuda.max_memory_allocated`` counts the rounded sizes.
* **Library workspace.** cuBLAS keeps a workspace per thread that runs matmuls, allocated
  through the caching allocator on its first matmul and kept; a training step has two such
  threads (the caller's forward, autograd's backward). Measured on an H100 with torch 2.11:
  33 MiB each, 66 MiB held after a fresh process's first step
  (``docs/benchmarks/gpu_h100/peak_breakdown.json``); on older GPUs torch's default
  ``CUBLAS_WORKSPACE_CONFIG`` is smaller, so the estimate errs high there. cuDNN's convolution
  workspaces are transient and algorithm-dependent: not modelled (see docs/estimate.md).
* **Kernel workspaces.** What a kernel allocates beyond its outputs depends on the kernel the
  machine picks: on a CPU without native bf16 a bf16 convolution takes im2col's slow path,
  whose column buffers made a bf16 step 7% larger than its fake-tensor estimate. For the CPU
  they are measured on this machine (the planner's op calibration, on real stand-ins of each
  heavy op small enough to run here); CUDA's are not modelled (cuDNN picks per algorithm).
* **Attention.** On CPU, ``scaled_dot_product_attention`` runs a flash kernel that saves the
  output and its log-sum-exp, not the attention matrix, as CUDA's flash and memory-efficient
  kernels do: the traced saves carry over.
* **Optimizers.** On CUDA torch's optimizers take their multi-tensor (``foreach``) path, whose
  temporaries span every parameter at once (Adam's ``sqrt`` of the second moments: one copy of
  the trainable parameters); the fake step is made to take it too.
* **Op cost.** A roofline: an op takes the longer of its FLOPs at the device's throughput and
  its bytes read and written at the device's bandwidth. The figures are typical *achieved*
  rates of the device class, assumptions rather than measurements; they steer which blocks the
  plan recomputes and the predicted recompute share, not any memory figure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lightning_tbp.estimate.live_bytes import rounded
from lightning_tbp.remat.trace import Trace


@dataclass(frozen=True)
class DeviceModel:
    name: str
    flops_per_second: float
    bytes_per_second: float
    allocation_rounding: int = 1
    library_workspace_bytes: int = 0
    foreach_optimizers: bool = False  # torch's optimizers default to their multi-tensor path here
    measures_workspaces: bool = False  # the kernels run on this machine: their workspaces are measured
    host_link_bytes_per_second: float = 0.0  # copies to the host tier and back, each way (0: no host tier)
    cuda_autocast: bool = False  # mixed precision widens CUDA autocast's float32 list (``autocast_policy.py``)
    # the all-gather writes a copy of its output first (gloo's, on CPU; NCCL writes into it)
    collectives_through_copy: bool = False

    def fill_costs(self, trace: Trace) -> None:
        """Give every traced op a forward and backward time (ns) from the roofline."""
        sizes = trace.storage_bytes
        for event in range(trace.num_events):
            moved = sum(trace.event_partial_inputs[event].get(s, sizes[s]) for s in trace.event_inputs[event])
            moved += sum(sizes[s] for s in trace.event_outputs[event])
            if not trace.event_outputs[event] and not trace.event_flops[event]:
                moved = 0  # a view: metadata only
            forward = max(trace.event_flops[event] / self.flops_per_second, moved / self.bytes_per_second) * 1e9
            trace.event_cost[event] = forward
            # a backward computes the gradients of the inputs (and of the weights for heavy ops)
            trace.event_backward_cost[event] = (2.0 if trace.event_traits[event].heavy else 1.0) * forward
        if self.host_link_bytes_per_second:  # an offloaded byte crosses the link twice, not overlapped
            per_byte = 2e9 / self.host_link_bytes_per_second
            trace.overheads = dataclasses.replace(trace.overheads, offload_ns_per_byte=per_byte)

    def round_storages(self, trace: Trace) -> None:
        """Storage sizes as the device's allocator counts them."""
        trace.storage_bytes = [rounded(size, self.allocation_rounding) for size in trace.storage_bytes]


#: An H100-class GPU at typical achieved rates (dense bf16 matmuls ~400 TFLOP/s, ~2.5 TB/s; pinned
#: host copies ~25 GB/s each way, what PCIe Gen4 x16 reaches and Gen5 passes).
CUDA = DeviceModel(
    "cuda",
    400e12,
    2.5e12,
    allocation_rounding=512,
    library_workspace_bytes=2 * 33 * 1024**2,
    foreach_optimizers=True,
    host_link_bytes_per_second=25e9,
    cuda_autocast=True,
)
#: A few CPU cores: what this project's tests and the ±5% check against exact CPU peaks use (the
#: host tier a memcpy into fresh memory, ~5 GB/s each way).
CPU = DeviceModel(
    "cpu", 100e9, 10e9, measures_workspaces=True, host_link_bytes_per_second=5e9, collectives_through_copy=True
)

DEVICES = {"cuda": CUDA, "cpu": CPU}


def device_model(name: str) -> DeviceModel:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r} for an estimate; choose one of {', '.join(DEVICES)}")
    return DEVICES[name]
