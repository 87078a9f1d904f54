"""What every tiny_backprop strategy adds to its Lightning base: the plan and DP-SGD.

``TinyBackpropMixin`` goes first in the bases of each strategy (single device, DDP, FSDP,
FSDP2); every method calls ``super()`` so the Lightning strategy underneath keeps its own
behaviour (precision plugin, accumulation, clipping, hooks, DDP's reducer, FSDP's sharding). The
plan only wraps blocks of the model in checkpoints, so ``loss.backward()`` itself recomputes what
the plan dropped. It is made lazily on the first training forward (the first batch fixes the
shapes), re-made for each new input shape, and logged with the predicted peak; the first step
that reuses a plan is metered and the measured peak logged next to it. In a run of several
processes every rank plans, and all adopt rank 0's plan (see :meth:`_agree_on_plan`).

With ``dp=...`` the backward becomes DP-SGD's (see :mod:`lightning_tbp.strategies.privacy`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from traceback import format_exception_only
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.profilers import PyTorchProfiler
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tbp.memory.breakdown import tensor_bytes
from lightning_tbp.memory.held import HeldMemory, held_memory, parameter_step_ratio
from lightning_tbp.memory.libraries import warm_library_workspaces
from lightning_tbp.memory.meters import frees_hidden_by_collectives
from lightning_tbp.optim import OptimizerInBackward
from lightning_tbp.optim.host_state import drop_masters, host_bytes_with_masters
from lightning_tbp.optim.step_cost import host_ns, in_backward_ns, trainable_of
from lightning_tbp.privacy import BACKWARD_PASSES, BufferStats
from lightning_tbp.remat import Plan, ShapePlan, format_bytes, parse_budget
from lightning_tbp.remat.budget import BudgetSpec
from lightning_tbp.remat.host_tier import HostTier, default_host_budget
from lightning_tbp.remat.overheads import step_overheads
from lightning_tbp.remat.signature import Signature
from lightning_tbp.remat.solve import DEFAULT_MAX_SLOWDOWN, check_max_slowdown
from lightning_tbp.remat.step import LoopAlternative, PriorGradients
from lightning_tbp.remat.verify import StepClock, can_meter, describe_step_time
from lightning_tbp.strategies.alongside import AlongsideMeter, storages_on
from lightning_tbp.strategies.loop import (
    LoopStep,
    LoopWatch,
    case_of_step,
    gradient_bytes,
    loop_model,
    release_gradients_before_validation,
    release_gradients_early,
)
from lightning_tbp.strategies.privacy import PrivacyConfig, PrivateTraining
from lightning_tbp.strategies.state_on_host import part_on_host
from lightning_tbp.strategies.step_in_backward import StepInBackward, blockers


class PlanAgreementError(RuntimeError):
    """The processes of a distributed run could not agree on one plan (raised on every rank)."""


def _private_training(
    dp: str | None,
    max_grad_norm: float | None,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    target_delta: float | None,
    accountant: str | None,
) -> PrivateTraining | None:
    """The DP part of a strategy, or None; DP options without ``dp`` are an error, not a silent no-op."""
    options = {
        "max_grad_norm": max_grad_norm,
        "noise_multiplier": noise_multiplier,
        "target_epsilon": target_epsilon,
        "target_delta": target_delta,
        "accountant": accountant,
    }
    given = {name: value for name, value in options.items() if value is not None}
    if dp is None:
        if given:
            raise ValueError(
                f"DP options {', '.join(f'{k}={v!r}' for k, v in given.items())} were given without dp=...: the run "
                "would train without privacy. Choose a mode (dp='ghost', 'flash', 'bookkeeping' or "
                "'flash_bookkeeping') or drop them"
            )
        return None
    return PrivateTraining(PrivacyConfig(dp, **given))


def default_target(model: nn.Module) -> tuple[nn.Module, str]:
    """The child of ``model`` with the most trainable parameters (the denoiser of a diffusion
    LightningModule), and its attribute path; ``model`` itself when no child trains."""
    children = [
        (sum(p.numel() for p in child.parameters() if p.requires_grad), name, child)
        for name, child in model.named_children()
    ]
    children = [c for c in children if c[0] > 0]
    if not children:
        return model, ""
    _, name, child = max(children, key=lambda c: c[0])
    return child, name


class TinyBackpropMixin:
    """The options and hooks shared by the tiny_backprop strategies.

    Args:
        memory_budget: per device; see :mod:`lightning_tbp.remat.budget`. A fraction is of the
            step's naive peak; bytes ("6GiB") are the device's total, from which the parameters
            and optimizer state held (its first step's state predicted) come off before the
            step is planned; "auto" is the free memory on CUDA. None: no plan (DP alone).
        target: attribute path (e.g. ``"unet"``) of the submodule to plan inside the
            LightningModule. Default: the direct child with the most trainable parameters.
        dp: train with differential privacy: ``"ghost"``, ``"flash"``, ``"bookkeeping"`` or
            ``"flash_bookkeeping"`` (None: no DP). ``training_step`` must then return the
            per-sample loss, shape [batch].
        max_grad_norm: the per-sample clipping threshold C (1.0 when not given).
        noise_multiplier: sigma (noise std sigma·C on the summed gradient); or instead
        target_epsilon: calibrate sigma so the planned steps spend at most this epsilon.
        target_delta: the delta of (epsilon, delta)-DP.
        accountant: ``"prv"`` (default) or ``"rdp"``, Opacus's accountants.
        verify_every_n_steps: besides the first three steps, meter one whole step of the loop in
            this many and check it against the plan (0: the first three only); see
            :class:`~lightning_tbp.strategies.loop.LoopWatch`.
        optimizer_in_backward: step the optimizer on each parameter inside the backward, as soon as
            its gradient is complete, and free the gradient at once (one device, DDP or FSDP2; see
            :mod:`lightning_tbp.strategies.step_in_backward` for what it refuses). The step then
            never holds every gradient; the plan counts it. ``"auto"`` (default): only where the
            budget cannot be met otherwise, and only for optimizers known to update each parameter
            from its own gradient (``lightning_tbp.optim.PER_PARAMETER``); the plan report says
            so, and an infeasible budget's error names what blocks it. ``True``: always (refused
            by name where it cannot run); ``False``: never.
        host_tier: ``"auto"`` (default): where a budget cannot be met on the device alone, the
            plan may offload blocks' saved activations to host memory and stream blocks' frozen
            weights from it, chosen per block by predicted time beside recomputation (see
            :mod:`lightning_tbp.remat.host_tier` and :mod:`lightning_tbp.remat.host_weights`;
            a byte budget may then be below what the weights take); where that is not enough
            either, the optimizer's state and step go to the host too, each parameter stepped
            there inside the backward (:mod:`lightning_tbp.optim.host_state`; needs
            ``optimizer_in_backward`` not ``False``); the plan report says so.
            ``"on"``: from the first plan; ``"off"``: never. Under DP the plan streams frozen
            weights (a LoRA's base) and keeps the optimizer's state on the host, but offloads no
            activations (the DP step backpropagates its first graph more than once). Not with
            FSDP (``"on"`` is refused there, ``"auto"`` keeps every byte on the device).
        host_budget: the most bytes the host tier may hold per process (None: 80% of the host
            memory available at setup, split between the processes of one node).
        optimizer_state_on_host: ``"auto"`` (default): the optimizer's state and step go to the
            host where the host tier (above) needs them; ``True``: from the first step, each
            parameter stepped there inside the backward, with or without a plan (what torchao's
            ``CPUOffloadOptimizer`` does, with the user's own optimizer; refused where the step
            cannot be inside the backward or with ``host_tier="off"`` or FSDP); ``False``:
            never.
        fp32_master_weights: keep a float32 master of each bf16 or fp16 trainable parameter on
            the host, with the optimizer's state in float32, and step the masters there (the
            device gets each master rounded to its dtype): a model trained in bf16
            (``precision="bf16-true"``) then loses no update too small for its weights' precision,
            at no device memory (:mod:`lightning_tbp.optim.host_state`). Puts the optimizer's
            state on the host from the first step (``optimizer_state_on_host="auto"`` becomes
            ``True``; refused with ``False`` and where that is refused). Checkpoints carry the
            masters.
        max_slowdown: the most times slower than without a plan a step may be predicted to run
            (recomputation, host copies, the optimizer's step on the host; default 10): a budget
            only a slower plan meets raises :class:`~lightning_tbp.remat.StallingPlanError`
            naming the parts. None: no limit.
    """

    #: Whether plans under this strategy may use the host tier: not where the plan's word with it
    #: is unproven (FSDP1, CUDA only: nothing of it has run here).
    host_tier_supported = True
    #: Whether the optimizer's state and step may go to the host (``optim/host_state.py``): not
    #: over sharded parameters (FSDP's), whose state lives in their shards.
    state_on_host_supported = True

    def __init__(
        self,
        memory_budget: BudgetSpec | None = "auto",
        target: str | None = None,
        dp: str | None = None,
        max_grad_norm: float | None = None,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        accountant: str | None = None,
        verify_every_n_steps: int = 50,
        optimizer_in_backward: bool | Literal["auto"] = "auto",
        host_tier: HostTier = "auto",
        host_budget: int | None = None,
        optimizer_state_on_host: bool | Literal["auto"] = "auto",
        fp32_master_weights: bool = False,
        max_slowdown: float | None = DEFAULT_MAX_SLOWDOWN,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_max_slowdown(max_slowdown)
        self.max_slowdown = max_slowdown
        if host_tier not in ("off", "on", "auto"):
            raise ValueError(f"host_tier must be 'off', 'on' or 'auto', got {host_tier!r}")
        if host_tier == "on" and not self.host_tier_supported:
            raise ValueError(
                f"host_tier is not available with {getattr(self, 'strategy_name', type(self).__name__)} yet (its "
                "plans with the host tier are not yet shown to keep their word); use tiny_backprop, "
                "tiny_backprop_ddp or tiny_backprop_fsdp2, or host_tier='off'"
            )
        self.host_tier: HostTier = host_tier
        if host_budget is not None and (isinstance(host_budget, bool) or host_budget < 0):
            raise ValueError(f"host_budget must be a number of bytes >= 0 or None, got {host_budget!r}")
        self.host_budget = host_budget
        if optimizer_in_backward not in (True, False, "auto"):
            raise ValueError(f"optimizer_in_backward must be True, False or 'auto', got {optimizer_in_backward!r}")
        if optimizer_state_on_host not in (True, False, "auto"):
            raise ValueError(f"optimizer_state_on_host must be True, False or 'auto', got {optimizer_state_on_host!r}")
        if not isinstance(fp32_master_weights, bool):
            raise ValueError(f"fp32_master_weights must be True or False, got {fp32_master_weights!r}")
        if fp32_master_weights and optimizer_state_on_host is False:
            raise ValueError(
                "fp32_master_weights keeps the masters beside the optimizer's state on the host, which "
                "optimizer_state_on_host=False keeps on the device; pass optimizer_state_on_host=True or 'auto'"
            )
        self.master_dtype = torch.float32 if fp32_master_weights else None
        if fp32_master_weights:
            optimizer_state_on_host = True  # the masters' state is theirs from the first step
        if optimizer_state_on_host is True:
            conflicts = {
                "optimizer_in_backward=False": optimizer_in_backward is False,
                "host_tier='off'": host_tier == "off",
                f"{getattr(self, 'strategy_name', type(self).__name__)}": not self.state_on_host_supported,
            }
            named = [name for name, conflict in conflicts.items() if conflict]
            if named:
                asked = "fp32_master_weights=True" if fp32_master_weights else "optimizer_state_on_host=True"
                instead = "train without it" if fp32_master_weights else "pass optimizer_state_on_host='auto'"
                raise ValueError(
                    f"{asked} steps each parameter on the host inside the backward, which "
                    f"cannot run with {', '.join(named)}; change it, or {instead}"
                )
        self.optimizer_state_on_host = optimizer_state_on_host
        if (
            isinstance(verify_every_n_steps, bool)
            or not isinstance(verify_every_n_steps, int)
            or verify_every_n_steps < 0
        ):
            raise ValueError(
                f"verify_every_n_steps must be an int >= 0 (0: only the first steps), got {verify_every_n_steps!r}"
            )
        self.verify_every_n_steps = verify_every_n_steps
        self.optimizer_in_backward = optimizer_in_backward
        self._in_backward: StepInBackward | None = None
        # fail on bad options before training
        self.memory_budget = None if memory_budget is None else parse_budget(memory_budget)
        self.privacy = _private_training(dp, max_grad_norm, noise_multiplier, target_epsilon, target_delta, accountant)
        self.target = target
        self.plan: Plan | None = None
        self._reported: set[int] = set()
        self._clock = StepClock()
        self._clock_hook: torch.utils.hooks.RemovableHandle | None = None
        self._watch: LoopWatch | None = None
        self._watched_plans: dict[int, ShapePlan] = {}  # by batch index: the plan each watched step ran
        self._loop_steps: list[tuple[LoopStep, ShapePlan]] = []
        self._watch_first = 3
        self._batch_index = -1
        self._last_batch_idx = -1
        self._plans_at_batch_start = 0
        self._alongside: AlongsideMeter | None = None

    # -- the parts of the Lightning strategy API that change --------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        trainer = self.lightning_module.trainer
        if self.privacy is not None and self.privacy.callback not in trainer.callbacks:
            # before Lightning restores callback states from a checkpoint: the accountant rides on it
            trainer.callbacks.append(self.privacy.callback)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == "fit" and self.privacy is not None:
            self.privacy.setup(trainer, self.lightning_module, self._gradient_sum())
        alternatives: list[LoopAlternative] = []
        if trainer.state.fn == "fit" and self.optimizer_in_backward is not False:
            self._in_backward, alternatives = self._step_in_backward(trainer)
        elif trainer.state.fn == "fit" and self.optimizer_state_on_host == "auto" and self._may_host():
            # named by an infeasible budget's error: the state on the host steps inside the backward
            alternatives = [
                self._state_on_host(None, ["optimizer_in_backward=False keeps the step after the backward"])
            ]
        host_state_cost = None
        if trainer.state.fn == "fit" and self.optimizer_state_on_host is True and self._in_backward is not None:
            host_state_cost = self._host_state_cost()  # while the state is the device's
            self._in_backward.keep_state_on_host(self.master_dtype)
        if trainer.state.fn == "fit" and self.memory_budget is not None:
            # a new plan for every fit: the last one was removed at teardown (also after a failed or
            # interrupted fit), and a resumed run's model may have changed since
            module, path = self.target_module()
            if not any(p.requires_grad for p in module.parameters()):
                raise ValueError(
                    f"tiny_backprop plans {path or 'the LightningModule'} ({type(module).__name__}), but none of its "
                    "parameters is trainable: there is no backward to plan. Set target= to the module that "
                    "trains, or memory_budget=None"
                )
            self._reported.clear()
            # the device's option overheads are probed once per process with buffers of their own
            # (a 4 MiB host round trip among them): now, before training, not inside the first
            # step's planning, whose memory counts in that step
            step_overheads(self.root_device)
            agree = self._agree_on_plan if self.world_size > 1 else None
            passes = 1 if self.privacy is None else BACKWARD_PASSES[self.privacy.config.mode]
            self._alongside = AlongsideMeter(self.lightning_module, self.root_device, self._made_since_batch_start)
            loop = loop_model(
                self.lightning_module,
                self.root_device,
                step_in_backward=self._in_backward is not None and self._in_backward.enabled,
            )
            if host_state_cost is not None:
                loop = loop.with_state_on_host(*host_state_cost)
            self.plan = Plan(
                module,
                self.memory_budget,
                measure=True,
                agree=agree,
                backward_passes=passes,
                held=self.held_memory,
                loop=loop,
                alternatives=alternatives,
                alongside=self._alongside,
                host_tier=self.host_tier if self.host_tier_supported else "off",
                max_slowdown=self.max_slowdown,
                host_budget_bytes=(
                    default_host_budget(getattr(self, "num_processes", 1))
                    if self.host_budget is None
                    else self.host_budget
                ),
            )
            # Lightning's PyTorchProfiler starts its session inside the loop, after a CPU meter's could have
            # started, and torch runs one at a time: the plan is then checked only where no profiler runs
            profiled = self.root_device.type == "cpu" and isinstance(trainer.profiler, PyTorchProfiler)
            every = self.verify_every_n_steps
            self._watch = (
                None
                if profiled
                else LoopWatch(
                    self.root_device, self._watch_first, every, frees_hidden_by_collectives(self.root_device)
                )
            )
            # held from here on, like the parameters: made by the first step's planning they were read as
            # every metered step's own (an SDXL-style zoo fit's first step on an H200: 66 MiB over its prediction)
            warm_library_workspaces(self.root_device)
            if self._in_backward is not None:
                self._in_backward.report_state_to(self._state_made)
            self._watched_plans.clear()
            self._loop_steps.clear()
            self._batch_index = -1
            self._clock = StepClock()
            # after the plan's own pre-hook, so a step starts once its plan is made
            self._clock_hook = module.register_forward_pre_hook(self._forward_started, with_kwargs=True)
            rank_zero_info(
                f"tiny_backprop: planning {path or type(module).__name__} ({type(module).__name__}) "
                f"under budget {self.memory_budget.describe()} per device at its first training batch"
            )

    def _forward_started(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.plan is not None and torch.is_grad_enabled():
            self._clock.forward_started(self.plan.current, args, kwargs, self.root_device)
            if self._watch is not None:
                self._watch.forward_starting(planned=len(self.plan.shape_plans) > self._plans_at_batch_start)

    def _made_since_batch_start(self) -> int | None:
        return None if self._watch is None else self._watch.made_since_batch_start()

    def _state_made(self, nbytes: int) -> None:
        """The optimizer stepping inside the backward makes a parameter's state: the meters keep it apart."""
        if self.plan is not None:
            self.plan.state_made(nbytes)
        if self._watch is not None:
            self._watch.state_made(nbytes)

    def _step_in_backward(self, trainer: pl.Trainer) -> tuple[StepInBackward | None, list[LoopAlternative]]:
        """The optimizer inside the backward as ``optimizer_in_backward`` asks: set up and on
        (``True``; what blocks it raises), or idle with the plan's alternative that turns it on
        (``"auto"``; what blocks it goes into the alternative, for the plan's errors to name);
        with the host tier, the alternative after it: the optimizer's state and step on the host."""
        # the state on the host from the start steps inside the backward from the start
        automatic = self.optimizer_in_backward == "auto" and self.optimizer_state_on_host is not True
        if automatic and self.memory_budget is None:
            return None, []  # no plan to take it
        blocked = self.fused_step_blockers(trainer, self.lightning_module, self.optimizers, automatic=automatic)
        if not automatic and blocked:
            raise ValueError(
                "optimizer_in_backward=True cannot run here: "
                + "; ".join(blocked)
                + ". Change these, or train with optimizer_in_backward=False"
            )
        stepping = None
        if not blocked:
            stepping = StepInBackward(
                trainer,
                self.optimizers[0],
                enabled=not automatic,
                private=self.privacy,
                hooks=self._gradients_final_when_accumulated,
            )
            self._announce_reduced_gradients(stepping.stepper)
        optimizers, device = self.optimizers, self.root_device
        alternatives = []
        if automatic:
            alternatives.append(
                LoopAlternative(
                    action="the optimizer step inside the backward (optimizer_in_backward='auto')",
                    loop=lambda loop: loop.with_step_in_backward(
                        parameter_step_ratio(optimizers, device), in_backward_ns(optimizers[0], device)
                    ),
                    adopt=stepping.enable if stepping is not None else _never,
                    blocked="; ".join(blocked) if blocked else None,
                )
            )
        if self.optimizer_state_on_host == "auto" and self._may_host():
            alternatives.append(self._state_on_host(stepping, blocked))
        return stepping, alternatives

    def _may_host(self) -> bool:
        """Whether plans under this strategy may keep the optimizer's state on the host."""
        return self.host_tier != "off" and self.state_on_host_supported

    def _host_state_cost(self) -> tuple[int, float, float]:
        """What the optimizer's state on the host keeps there (a copy of each trainable weight,
        the state, made or to come), the time of its steps there with the copies, and of the same
        steps on the device (measured); asked while the state is still the device's."""
        optimizer, device = self.optimizers[0], self.root_device
        if self.master_dtype is not None:
            host_bytes = host_bytes_with_masters(optimizer, self.master_dtype)
        else:
            host_bytes = trainable_of(optimizer)[1] + self.held_memory().optimizer_state
        return host_bytes, host_ns(optimizer, device, self.master_dtype), in_backward_ns(optimizer, device)

    def _state_on_host(self, stepping: StepInBackward | None, blocked: list[str]) -> LoopAlternative:
        """The plan's alternative that keeps the optimizer's state on the host and steps each
        parameter there inside the backward (``optim/host_state.py``), priced when first tried."""
        costs: list[tuple[int, float, float]] = []

        def cost() -> tuple[int, float, float]:
            if not costs:
                costs.append(self._host_state_cost())
            return costs[0]

        def adopt(hosted: list[torch.Tensor] | None = None) -> None:
            assert stepping is not None
            stepping.enable()
            stepping.keep_state_on_host(self.master_dtype, hosted)

        def narrowed(short: int) -> LoopAlternative | None:
            if stepping is None or self.master_dtype is not None or self.plan is None:
                return None  # float32 masters are all or none: a model's weights stepped alike
            return part_on_host(self.optimizers[0], self.root_device, self.plan.module, adopt, short)

        return LoopAlternative(
            action="the optimizer's state and step on the host (host_tier)",
            loop=lambda loop: loop.with_state_on_host(*cost()),
            adopt=adopt,
            blocked="; ".join(blocked) if blocked else None,
            held=lambda held: dataclasses.replace(held, optimizer_state=0, optimizer_state_pending=0),
            host_tier=True,
            narrowed=narrowed,
        )

    #: Whether a gradient autograd accumulates into ``.grad`` is the one to step on (not so where a
    #: reduction across devices follows it: the strategy then announces each parameter itself).
    _gradients_final_when_accumulated = True

    def _reduction_kind(self) -> str | None:
        """How this strategy reduces gradients across devices: None on one device, else its kind
        (``step_in_backward.REDUCES_PER_BUCKET`` names those the optimizer can step inside)."""
        return None if isinstance(self, SingleDeviceStrategy) else type(self).__name__

    def fused_step_blockers(
        self, trainer: pl.Trainer, module: pl.LightningModule, optimizers: list[Optimizer], *, automatic: bool
    ) -> list[str]:
        """What keeps ``optimizers`` from stepping inside ``module``'s backward in this fit, by
        name (``step_in_backward.blockers``, and this strategy's own set-up); ``automatic``:
        asked for ``optimizer_in_backward="auto"``. ``tbp estimate`` asks it of a config's strategy."""
        private = self.privacy is not None
        devices = self._reduction_kind()
        found = blockers(trainer, module, optimizers, private=private, devices=devices, automatic=automatic)
        return found + self._fused_step_blockers()

    def _fused_step_blockers(self) -> list[str]:
        """What in this strategy's own set-up keeps the optimizer out of the backward, by name."""
        return []

    def _announce_reduced_gradients(self, stepper: OptimizerInBackward) -> None:
        """Hand each parameter's reduced gradient to ``stepper`` where autograd's hooks do not
        (nothing to do on one device)."""

    def held_memory(self) -> HeldMemory:
        """This device's parameters (shards, EMA copies included) and optimizer state, the part
        its first step will create included: a byte budget is the device's total, less these."""
        return held_memory(self.lightning_module, self.optimizers, self.root_device)

    def communication_buffer_bytes(self) -> int:
        """Bytes held for communication that no parameter, gradient or optimizer state accounts
        for (none on one device)."""
        return 0

    def _gradient_sum(self) -> Callable[[list[torch.Tensor]], None] | None:
        """How DP sums the ranks' clipped gradients (None: one process, nothing to sum)."""
        return None

    def target_module(self) -> tuple[nn.Module, str]:
        """The submodule the plan covers, and its attribute path."""
        model = self.lightning_module
        assert model is not None
        if self.target is not None:
            try:
                return model.get_submodule(self.target), self.target
            except AttributeError as error:
                children = ", ".join(name for name, _ in model.named_children()) or "none"
                raise ValueError(
                    f"tiny_backprop target={self.target!r}: {type(model).__name__} has no such submodule "
                    f"({error}). Its direct children: {children}"
                ) from None
        return default_target(model)

    def _agree_on_plan(self, signature: Signature, local: ShapePlan | Exception) -> ShapePlan:
        """Every rank planned; all adopt rank 0's plan, or all raise if any rank failed.

        Plans are solved from measured op times, which differ between processes, so each rank's
        own solution may differ; adopting one makes every rank recompute the same blocks. A rank
        whose input shapes differ from rank 0's, or that could not plan, stops all of them here
        (one collective, so no rank is left waiting)."""
        report = (signature, local if isinstance(local, ShapePlan) else "".join(format_exception_only(local)).strip())
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, report)
        failures = [f"rank {rank}: {plan}" for rank, (_, plan) in enumerate(gathered) if isinstance(plan, str)]
        if failures:
            error = PlanAgreementError("tiny_backprop could not plan on every rank:\n" + "\n".join(failures))
            raise error from (local if isinstance(local, Exception) else None)
        if any(other != gathered[0][0] for other, _ in gathered):
            shapes = "\n".join(f"rank {rank}: {sig[1]}" for rank, (sig, _) in enumerate(gathered))
            raise PlanAgreementError(
                f"ranks planned for different input shapes; every rank must see the same:\n{shapes}"
            )
        return gathered[0][1]

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.plan is None:
            return
        module, path = self.target_module()
        frozen_modes = [name or "(root)" for name, m in module.named_modules() if not m.training]
        if frozen_modes:
            shown = ", ".join(frozen_modes[:5]) + (", ..." if len(frozen_modes) > 5 else "")
            warnings.warn(
                f"tiny_backprop: {len(frozen_modes)} module(s) of {path or 'the LightningModule'} "
                f"({type(module).__name__}) are in eval mode at the start of training ({shown}), so dropout "
                "does not run and the plan is made for that step. diffusers' from_pretrained returns a model in "
                "eval mode and Lightning keeps submodule modes: call .train() on it in your LightningModule",
                stacklevel=2,
            )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer
        if self.privacy is not None and trainer.state.stage == RunningStage.TRAINING:
            dataloader = self.privacy.process_train_loader(dataloader, trainer, self.global_rank, self.world_size)
            if self.plan is not None:
                # Poisson batches vary in size: one plan per shape, made for a batch no rank will exceed
                self.plan.batch_ceiling = self.privacy.micro_batch_ceiling
        return dataloader

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.privacy is not None and self.privacy.is_empty(args[0] if args else None):
            return None  # a Poisson micro-batch can be empty: no forward; noise still comes at the step
        module = self.lightning_module
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
        release_gradients_early(module, batch_idx)  # see ``strategies/loop.py``
        if self.plan is not None:
            case = case_of_step(module, gradient_bytes(self.target_module()[0].parameters()), batch_idx)
            self._widen_loop(case)
            if self._watch is not None:
                self._watch.step_case(case)
        output = super().training_step(*args, **kwargs)
        if self.plan is not None and self.plan.current is not None:
            self._watched_plans[self._batch_index] = self.plan.current
        if self._defers_plan_checks() and self.plan is not None and self.plan.checking:
            assert self._watch is not None
            if not self._watch.watched(self._batch_index):  # the plan this step checks, checked by the next
                self._watch.watch_also(self._batch_index + 1)
        if self._watch is not None:
            self._watch.training_step_ended(self._batch_index, can_meter(self.root_device))
        return output

    def _widen_loop(self, case: PriorGradients) -> None:
        """A step starts with gradients the plan's loop did not count (manual optimisation that
        keeps them, an optimizer whose ``zero_grad`` zeroes in place): plan for that case too,
        before this step's forward."""
        assert self.plan is not None
        loop = self.plan.loop
        if case in loop.gradients:
            return
        rank_zero_info(
            f"tiny_backprop: a step starts with parameter gradients alive ({case.value}), which the plan did not "
            "count: planning for that too"
        )
        self.plan.set_loop(dataclasses.replace(loop, gradients=loop.gradients | {case}))

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._batch_index += 1
        self._last_batch_idx = batch_idx
        self._plans_at_batch_start = 0 if self.plan is None else len(self.plan.shape_plans)
        if self._alongside is not None:
            self._alongside.batch_started(batch)
        if self._watch is None:
            return
        module = self.lightning_module
        alive = gradient_bytes(module.parameters()) + sum(storages_on(batch, self.root_device).values())
        state = self._optimizer_state_bytes()
        replanned = self._check_loop_step(self._watch.previous_step_ended(alive, state))
        if replanned and self._defers_plan_checks():  # the corrected plan runs from this step: meter it
            self._watch.watch_also(self._batch_index)
        self._watch.batch_started(self._batch_index, alive, state, can_meter(self.root_device))

    def _defers_plan_checks(self) -> bool:
        """Whether a plan's own check (its forward and backward, metered) is left to the whole steps
        of the loop: where the CPU meter misses frees (gloo's threads), only a whole step, balanced
        against what training holds at its end, says how far its reading is too high."""
        return self._watch is not None and self._watch.frees_unseen

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self.lightning_module.trainer
        if not trainer.training and trainer.state.fn == "fit" and self._batch_index >= 0:  # inside fit
            if self._watch is not None:
                self._check_loop_step(self._watch.validation_started(self._optimizer_state_bytes()))
            release_gradients_before_validation(self.lightning_module, self._last_batch_idx)

    def _optimizer_state_bytes(self) -> int:
        return tensor_bytes(self.lightning_module, self.optimizers, self.root_device).optimizer_state

    def _check_loop_step(self, step: LoopStep | None) -> bool:
        """A whole metered step of the loop against its plan's prediction for its case; returns
        whether the plan was corrected."""
        shape_plan = None if step is None else self._watched_plans.pop(step.index, None)
        if step is None or shape_plan is None or self.plan is None:
            return False
        predicted = shape_plan.predicted_case_bytes(step.case)
        # the meter never saw the weights streamed to the host leave: against the parameters as loaded
        step = dataclasses.replace(step, peak_bytes=step.peak_bytes - self.plan.streamed_bytes)
        within = step.lowest_bytes <= shape_plan.budget_bytes
        self._loop_steps.append((step, shape_plan))
        ratio = shape_plan.ratio(step.peak_bytes, predicted)
        if step.index < self._watch_first or not within or abs(ratio - 1) > 0.05:
            peaked = shape_plan.level(step.peak_bytes)
            if step.unseen_bytes:
                peaked = (
                    f"between {shape_plan.level(step.lowest_bytes)} and {peaked} (gloo's threads freed "
                    f"{format_bytes(step.unseen_bytes)} where the CPU meter does not look)"
                )
            rank_zero_info(
                f"tiny_backprop: training step {step.index} (gradients at its forward: {step.case.value}) peaked at "
                f"{peaked} above what training holds, {ratio:.3f}x the "
                f"predicted {shape_plan.level(predicted)}, {'within' if within else 'OVER'} the budget "
                f"{shape_plan.level(shape_plan.budget_bytes)} on rank 0"
            )
        planning = step.planning_peak_bytes
        limited = not self.plan.budget.is_fraction_default(self.root_device)  # "auto" on CPU is a default fraction
        if planning is not None and planning > shape_plan.budget_bytes and limited:
            rank_zero_warn(
                f"tiny_backprop: planning at training step {step.index} (the profile and the op and block timings, "
                f"once per input shape) peaked at {shape_plan.level(planning)} above what training holds, over the "
                f"budget {shape_plan.level(shape_plan.budget_bytes)} its step keeps: a model this small spends more on "
                "being measured than on its step. Give it a larger budget, or plan it once outside the loop "
                "(lightning_tbp.rematerialize) and check it with plan.verify"
            )
        return self._replan_if_over(shape_plan, step.lowest_bytes, predicted)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self.privacy is not None:  # the loss's backward() at the chain's end is the engine's
            self.privacy.backward_starting(closure_loss, self.lightning_module.trainer)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if self.privacy is not None:
            self.privacy.backward_abandoned()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_step() -> Any:
            result = closure()  # the last micro-batch's forward and backward
            stepped = self._in_backward is not None and self._in_backward.enabled
            if self._in_backward is not None:
                self._in_backward.backward_done()
            if self.privacy is not None and not stepped:
                self.privacy.finish_logical_batch(add_noise=self.global_rank == 0)
            if self._watch is not None:
                self._watch.optimizer_stepping()
            return result

        if self.privacy is not None:
            self.privacy.begin_logical_batch()  # before its last backward, which may step the parameters
        lightning_step = super().optimizer_step
        if self._in_backward is not None:
            return self._in_backward.optimizer_step(
                optimizer, lambda stepped: lightning_step(stepped, closure_then_step, model, **kwargs)
            )
        return lightning_step(optimizer, closure_then_step, model, **kwargs)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._watch is not None:
            self._check_loop_step(self._watch.stop(self._optimizer_state_bytes()))

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.privacy is not None:
            self.privacy.backward_ended()
        super().post_backward(closure_loss)
        if self.plan is None:
            return
        checked = self.plan.finish_measurement()
        current = self.plan.current
        timed = self._clock.backward_ended(current, checked is not None, self.root_device)
        if current is not None and id(current) not in self._reported:
            self._reported.add(id(current))
            rank_zero_info(f"tiny_backprop plan:\n{self.plan.report(current)}")
        if checked is not None:
            self._check_plan(checked)
        if timed is not None:
            rank_zero_info(f"tiny_backprop: {describe_step_time(timed)} on rank 0")

    def _check_plan(self, checked: ShapePlan) -> None:
        """The plan's metered forward and backward (a step that started without gradients) against
        its prediction and the budget: logged, and over the budget re-planned (unless the loop's
        whole steps decide, :meth:`_defers_plan_checks`)."""
        measured = checked.measured_peak_bytes
        comparable = checked.measured_at_planned_batch  # else the prediction was for a larger batch
        predicted = checked.predicted_case_bytes(PriorGradients.RELEASED)
        if measured is not None:
            against = (
                f"vs predicted {checked.level(predicted)} ({checked.ratio(measured, predicted):.3f}x)"
                if comparable
                else f"at batch {checked.measured_batch_size} (planned for up to {checked.batch_size})"
            )
            loss = checked.measured_loss_bytes
            counted = format_bytes(checked.loss_bytes)
            loss = "" if loss is None else f"; its loss {format_bytes(loss)}, counted as {counted}"
            deferred = (
                " (at most: gloo's threads free buffers where the CPU meter does not look, so the loop's whole "
                "step, balanced at its end, decides)"
                if self._defers_plan_checks()
                else ""
            )
            rank_zero_info(
                f"tiny_backprop: measured peak {checked.level(measured)} (forward and backward) {against}, "
                f"{'within' if measured <= checked.budget_bytes else 'OVER'} the budget "
                f"{checked.level(checked.budget_bytes)} on rank 0{loss}{deferred}"
            )
        if not self._defers_plan_checks():
            self._replan_if_over(checked, measured, predicted if comparable else None)

    def _replan_if_over(self, checked: ShapePlan, measured: int | None, predicted: int | None) -> bool:
        """Re-plan ``checked`` with the measured error folded in if ``measured`` passed its budget on
        any process (every process alike; ``predicted`` None: not comparable, a smaller batch);
        returns whether it did."""
        assert self.plan is not None
        ratio = 0.0 if measured is None else checked.ratio(measured, checked.budget_bytes)
        if measured is not None and predicted is not None:
            ratio = max(ratio, checked.ratio(measured, predicted))
        over = float(measured is not None and measured > checked.budget_bytes)
        if self.world_size > 1:  # one decision for all processes: the worst of them
            ratio, over = (
                float(self.reduce(torch.tensor(v, device=self.root_device), reduce_op="max")) for v in (ratio, over)
            )
        if over and any(checked is planned for planned in self.plan.shape_plans.values()):
            return self.plan.correct(checked, ratio) is not None
        return False

    def loop_steps(self) -> list[dict[str, Any]]:
        """The whole steps of the loop metered so far, each with its plan's prediction and budget."""
        return [
            {
                "step": step.index,
                "gradients_at_forward": step.case.value,
                "peak_bytes": step.peak_bytes,
                "planning_peak_bytes": step.planning_peak_bytes,
                "predicted_bytes": shape_plan.predicted_case_bytes(step.case),
                "budget_bytes": shape_plan.budget_bytes,
                # measured over predicted as device levels (``ShapePlan.ratio``: streamed weights back in)
                "ratio": shape_plan.ratio(step.peak_bytes, shape_plan.predicted_case_bytes(step.case)),
                # where the CPU meter misses frees (gloo): the step peaked between peak_bytes less these and peak_bytes
                "unseen_bytes": step.unseen_bytes,
            }
            for step, shape_plan in self._loop_steps
        ]

    def dp_buffer_stats(self) -> BufferStats | None:
        """The DP engine's held bytes (per-sample norms, materialised per-sample gradients,
        bookkeeping's operands): now, and the peak of its last backward. None without DP."""
        if self.privacy is None or self.privacy.engine is None:
            return None
        return self.privacy.engine.buffers

    def memory_report_config(self) -> dict[str, Any]:
        """What ``MemoryProfilerCallback`` records about this strategy: the plan in force, the DP mode,
        the whole steps of the loop it metered against the plan."""
        dp = None
        if self.privacy is not None:
            state = self.privacy.state_dict()
            dp = {**state["config"], **{k: state[k] for k in ("epsilon", "noise_multiplier", "planned_steps")}}
        if self.plan is None or not self.plan.shape_plans:
            return {"plan": None, "dp": dp}
        summary = self.plan.to_dict()  # the plan in force (the last made, where a correction awaits its call)
        for detail in ("blocks", "edges", "signature"):
            summary.pop(detail)
        return {"plan": summary, "dp": dp, "loop_steps": self.loop_steps()}

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """As Lightning's; a checkpoint's float32 masters are dropped where this run keeps none
        (they would be loaded onto the device as state, cast to the parameters' dtype)."""
        if self.master_dtype is None:
            dropped = drop_masters(checkpoint["optimizer_states"])
            if dropped:
                rank_zero_warn(
                    f"tiny_backprop: the checkpoint holds float32 masters of {dropped} parameters, which this run "
                    "drops (fp32_master_weights=False): training goes on from the weights as saved. Pass "
                    "fp32_master_weights=True to go on from the masters"
                )
        super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]  # the Lightning strategy's

    @override
    def teardown(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        if self.privacy is not None:
            self.privacy.teardown()
        if self._in_backward is not None:
            self._in_backward.teardown()
            self._in_backward = None
        if self._clock_hook is not None:
            self._clock_hook.remove()
            self._clock_hook = None
        if self.plan is not None:
            self.plan.remove()  # the module is restored; the plan object stays for its reports
        super().teardown()


def _never() -> None:
    raise AssertionError("a blocked alternative is never taken")
