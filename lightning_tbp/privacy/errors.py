"""The DP engine's refusals: each says which parameter or loss, where, and what to do."""

from __future__ import annotations


class CoverageError(ValueError):
    """A trainable parameter would get a gradient the engine cannot clip exactly per sample.

    Raised before the step that would use it (at ``attach``, or in the backward's checks before
    any gradient is written), naming the parameter, the module or op that uses it, and the fix.
    """


class PerSampleLossError(ValueError):
    """The loss handed to ``backward`` is not one value per sample."""


FIXES = (
    "freeze it (param.requires_grad_(False)), untie it, or register a per-sample handler for the layer "
    "that uses it (lightning_tbp.privacy.register)"
)
"""The ways out of a refusal, quoted by every coverage error."""
