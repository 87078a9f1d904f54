"""Privacy accounting through Opacus's accountants (PRV by default, RDP available)."""

from __future__ import annotations

import math
from typing import Any

from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier

ACCOUNTANTS = ("prv", "rdp")


class PrivacyAccountant:
    """Counts the privacy spent by noisy steps: ``step()`` per optimizer step, ``epsilon()`` any time."""

    def __init__(self, mechanism: str = "prv", delta: float = 1e-5) -> None:
        if mechanism not in ACCOUNTANTS:
            raise ValueError(f"unknown accountant {mechanism!r}; choose one of {', '.join(ACCOUNTANTS)}")
        if not 0 < delta < 1:
            raise ValueError(f"target_delta must be in (0, 1), got {delta}")
        self.mechanism = mechanism
        self.delta = delta
        self._accountant = create_accountant(mechanism)

    def step(self, noise_multiplier: float, sample_rate: float) -> None:
        self._accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    @property
    def steps(self) -> int:
        return sum(count for _, _, count in self._accountant.history)

    def epsilon(self) -> float:
        """ε spent so far at ``delta``: 0 before the first step, infinite after a noiseless one."""
        if not self._accountant.history:
            return 0.0
        if any(noise_multiplier == 0 for noise_multiplier, _, _ in self._accountant.history):
            return math.inf
        return float(self._accountant.get_epsilon(delta=self.delta))

    def state_dict(self) -> dict[str, Any]:
        return {"mechanism": self.mechanism, "delta": self.delta, "history": list(self._accountant.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["mechanism"] != self.mechanism:
            raise ValueError(
                f"the checkpoint's privacy was counted with the {state['mechanism']!r} accountant, "
                f"this run uses {self.mechanism!r}"
            )
        self._accountant.history = [tuple(entry) for entry in state["history"]]


def calibrate_noise(target_epsilon: float, delta: float, sample_rate: float, steps: int, mechanism: str) -> float:
    """The smallest noise multiplier that keeps ``steps`` steps at rate ``sample_rate`` within ε."""
    if target_epsilon <= 0:
        raise ValueError(f"target_epsilon must be positive, got {target_epsilon}")
    if steps <= 0:
        raise ValueError(
            "calibrating noise to target_epsilon needs the planned number of steps: set max_steps or max_epochs"
        )
    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=mechanism,
        )
    )
