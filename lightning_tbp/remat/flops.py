"""FLOPs of one aten op, from torch's own FLOP formulas.

torch's registry (``torch.utils.flop_counter``) lacks the CPU flash-attention kernel that
``scaled_dot_product_attention`` dispatches to on CPU; it is added here with torch's own SDPA
formula so that attention is counted on every device. Pass ``FLOP_FORMULAS`` to
``FlopCounterMode(custom_mapping=FLOP_FORMULAS)`` so that benchmarks count what the planner counts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_flop_count, shape_wrapper

from lightning_tbp.compat import OpOverload, op_packet

aten = torch.ops.aten


def _cpu_flash_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


#: Shape-based formulas for ops torch's registry misses, keyed by op overload packet.
FLOP_FORMULAS: dict[Any, Any] = {}
if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
    FLOP_FORMULAS[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_flash_sdpa_flop

_EXTRA = {packet: shape_wrapper(formula) for packet, formula in FLOP_FORMULAS.items()}


def flop_count(func: OpOverload, args: tuple, kwargs: dict, out: object) -> int:
    """FLOPs of ``func(*args, **kwargs) -> out``; 0 for ops without a formula."""
    packet = op_packet(func)
    formula = flop_registry.get(packet) or _EXTRA.get(packet)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))
