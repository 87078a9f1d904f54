"""Privacy accounting through Opacus's accountants (PRV by default, RDP available)."""

from __future__ import annotations

import math
from typing import Any

from opacus.accountants import create_accountant

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
    def history(self) -> list[tuple[float, float, int]]:
        """(noise multiplier, sample rate, steps) of every step taken so far."""
        return list(self._accountant.history)

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


def epsilon_of(history: list[tuple[float, float, int]], delta: float, mechanism: str) -> float:
    """ε at ``delta`` of a history of (noise multiplier, sample rate, steps), as ``PrivacyAccountant``."""
    accountant = PrivacyAccountant(mechanism, delta)
    accountant.load_state_dict({"mechanism": mechanism, "delta": delta, "history": history})
    return accountant.epsilon()


class BudgetSpentError(ValueError):
    """The privacy already spent leaves no room for the steps still planned."""


#: Calibration stops when the planned run's ε is this close below the target (as Opacus).
EPSILON_TOLERANCE = 0.01
_MAX_NOISE_MULTIPLIER = 2.0**20


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    mechanism: str,
    history: list[tuple[float, float, int]] | None = None,
) -> float:
    """The smallest noise multiplier (to ``EPSILON_TOLERANCE``) with which ``steps`` more steps at
    rate ``sample_rate``, after ``history`` (steps already taken), stay within ``target_epsilon``.

    A resumed run passes what it already spent as ``history``, so the remaining steps get the
    noise that lands the whole run on its target; if the spent part alone reaches the target,
    :class:`BudgetSpentError` says so with the numbers."""
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be positive and finite, got {target_epsilon}")
    history = list(history or [])
    if steps <= 0:
        raise ValueError(
            "calibrating noise to target_epsilon needs the planned number of steps: set max_steps or max_epochs"
            + (f" above the {sum(h[2] for h in history)} steps already taken" if history else "")
        )
    spent = epsilon_of(history, delta, mechanism) if history else 0.0
    if spent >= target_epsilon:
        raise BudgetSpentError(
            f"the run has spent epsilon {spent:.3f} (delta {delta}) in {sum(h[2] for h in history)} steps, which "
            f"reaches its target {target_epsilon}: no noise keeps {steps} more steps within it. Raise "
            "target_epsilon or train no further"
        )

    def planned(sigma: float) -> float:
        return epsilon_of([*history, (sigma, sample_rate, steps)], delta, mechanism)

    low, high = 0.0, 10.0
    while planned(high) > target_epsilon:
        low, high = high, 2 * high
        if high > _MAX_NOISE_MULTIPLIER:
            raise BudgetSpentError(
                f"the run has spent epsilon {spent:.3f} of its target {target_epsilon} (delta {delta}); no noise "
                f"multiplier keeps {steps} more steps at sampling rate {sample_rate:.5f} within the target. Raise "
                "target_epsilon or train no further"
            )
    while target_epsilon - planned(high) > EPSILON_TOLERANCE and high - low > 1e-9 * high:
        middle = (low + high) / 2
        if planned(middle) > target_epsilon:
            low = middle
        else:
            high = middle
    return high
