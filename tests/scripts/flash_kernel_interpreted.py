"""Run the Triton flash-norm kernel and compare it with PyTorch: under Triton's CPU interpreter,
or compiled on a GPU with ``cuda`` as the argument.

TRITON_INTERPRET must be set before Triton is imported, so this runs as its own process.
Prints the largest relative error; exits 1 if any shape is off.
"""

import os
import sys

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402  (after TRITON_INTERPRET)

from lightning_tbp.privacy.kernels.flash_norm import triton_flash_norm_sq  # noqa: E402
from lightning_tbp.privacy.layers import outer  # noqa: E402

torch.manual_seed(0)
worst = 0.0
# (batch, groups, positions, in, out): single position, ragged tiles, groups, a strided input
for batch, groups, positions, in_features, out_features in [(4, 1, 1, 20, 17), (2, 2, 40, 33, 50), (3, 1, 70, 8, 9)]:
    a = torch.randn(batch, groups, positions, in_features, device=DEVICE)
    g = torch.randn(batch, groups, positions, out_features, device=DEVICE)
    reference = outer.weight_norm_sq(a, g, "materialise")
    for operand in (a, a.transpose(2, 3).contiguous().transpose(2, 3)):
        worst = max(worst, float((triton_flash_norm_sq(operand, g) / reference - 1).abs().max()))
    # bf16 operands are widened inside the kernel: compare with the fp32 norm of the rounded values
    a16, g16 = a.bfloat16(), g.bfloat16()
    reference16 = outer.weight_norm_sq(a16.float(), g16.float(), "materialise")
    worst = max(worst, float((triton_flash_norm_sq(a16, g16) / reference16 - 1).abs().max()))
print(f"max relative error {worst:.3e}")
sys.exit(0 if worst < 1e-5 else 1)
