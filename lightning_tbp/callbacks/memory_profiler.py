"""``MemoryProfilerCallback``: where every byte of a training step goes, stage by stage.

Sampled batches are metered at four points: ``batch_start``, ``after_forward`` (Lightning's
``on_before_backward``), ``after_backward`` and ``after_step`` (batch end, after the optimizer
step when one ran). Each snapshot holds the current and the peak allocation since the previous
point and a breakdown (parameters, gradients, optimizer state, activations, DP buffers, other).
The callback only observes: it changes nothing in training.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import PyTorchProfiler
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_tbp.callbacks.strategy_info import MemoryReportingStrategy
from lightning_tbp.compat import dump_cuda_memory_snapshot, record_cuda_memory_history, stop_cuda_memory_history
from lightning_tbp.memory.breakdown import Breakdown, split_untracked, tensor_bytes
from lightning_tbp.memory.record import Snapshot, build_run_record, format_stage_table, write_run_record
from lightning_tbp.memory.stages import StageMeter, stage_meter_for


class MemoryProfilerCallback(Callback):
    """Memory snapshots per training stage, a breakdown, timing, a JSON per rank and a summary.

    Args:
        every_n_steps: meter one training batch in this many (after the warm-up). Metering on
            CPU runs the batch inside a profiler, which slows that batch down; on CUDA it only
            reads allocator counters.
        warmup_steps: batches to skip before the first metered one. The first batch makes a
            tiny_backprop plan and the optimizer's state; meter it too with 0 (the meters nest,
            so the plan's own measurements are unaffected).
        output_dir: where ``memory_rank{R}.json`` (and CUDA history/OOM snapshots) go.
            Default: ``<trainer.log_dir>/memory``, or ``<default_root_dir>/memory`` without a logger.
        record_history: CUDA only: record the allocator's history for the whole fit and dump
            ``memory_history_rank{R}.pickle`` at its end (open it in https://pytorch.org/memory_viz).
        history_max_entries: allocator events kept in the history ring buffer.
        experiment: the run's name in the JSON and in reports; default ``<Module>-<strategy>``.
        log_metrics: also send ``memory/*`` metrics of each metered batch to the Trainer's loggers.

    Whatever records the history, a CUDA out-of-memory error inside fit dumps the allocator's
    snapshot to ``oom_snapshot_rank{R}.pickle`` and prints its path.
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        warmup_steps: int = 2,
        output_dir: str | os.PathLike[str] | None = None,
        record_history: bool = False,
        history_max_entries: int = 100_000,
        experiment: str | None = None,
        log_metrics: bool = True,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1 (meter one batch in N), got {every_n_steps!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if not isinstance(history_max_entries, int) or history_max_entries < 1:
            raise ValueError(f"history_max_entries must be an int >= 1, got {history_max_entries!r}")
        self.every_n_steps = every_n_steps
        self.warmup_steps = warmup_steps
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.record_history = record_history
        self.history_max_entries = history_max_entries
        self.experiment = experiment
        self.log_metrics = log_metrics
        self.record: dict[str, Any] | None = None
        """The last run's record (also written as JSON)."""
        self._reset()

    def _reset(self) -> None:
        self._meter: StageMeter | None = None
        self._device = torch.device("cpu")
        self._batch_index = -1
        self._sampling = False
        self._pending: list[tuple[str, float, int, Breakdown, int | None]] = []
        self._snapshots: list[Snapshot] = []
        self._step_times: list[float] = []
        self._metered_step_times: list[float] = []
        self._cuda_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._step_started: float | torch.cuda.Event | None = None
        self._fit_started = 0.0
        self._batch_size: int | None = None
        self._history_on = False
        self._ready = False
        self._held_beside = 0  # the strategy's communication buffers, when a batch is sampled

    # -- set-up: every option is checked before the first batch -----------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset()
        self._device = trainer.strategy.root_device
        self._meter = stage_meter_for(self._device)
        profiler = trainer.profiler  # type: ignore[attr-defined]  # set by Lightning's profiler connector
        if self._device.type == "cpu" and isinstance(profiler, PyTorchProfiler):
            raise ValueError(
                "MemoryProfilerCallback meters CPU memory with torch.profiler, which cannot run inside the "
                "Trainer's PyTorchProfiler: use one of the two"
            )
        if self.record_history and self._device.type != "cuda":
            warnings.warn(
                f"MemoryProfilerCallback(record_history=True) records CUDA allocator history; this run is on "
                f"{self._device.type}, so no history will be written (the stage snapshots still are)",
                stacklevel=2,
            )
        self.output_dir = self._writable_output_dir(trainer)
        self._ready = True

    def _writable_output_dir(self, trainer: pl.Trainer) -> Path:
        directory = self.output_dir
        if directory is None:
            directory = Path(trainer.log_dir or trainer.default_root_dir) / "memory"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".write_probe_rank{trainer.global_rank}"
            probe.write_text("")
            probe.unlink()
        except OSError as error:
            raise ValueError(
                f"MemoryProfilerCallback cannot write to output_dir {str(directory)!r}: {error}"
            ) from error
        return directory

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_started = time.perf_counter()
        if self.record_history and self._device.type == "cuda":
            record_cuda_memory_history(self.history_max_entries)
            self._history_on = True

    # -- the four stages of a batch -----------------------------------------------------------

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self._meter is not None
        self._batch_index += 1
        self._sampling = self._is_sampled(self._batch_index)
        if self._batch_size is None:
            self._batch_size = extract_batch_size(batch)
        if self._sampling:
            strategy = trainer.strategy
            reporting = strategy if isinstance(strategy, MemoryReportingStrategy) else None
            self._held_beside = 0 if reporting is None else reporting.communication_buffer_bytes()
            if not self._meter.active:
                self._meter.begin()
            self._pending = []
            self._mark(trainer, pl_module, "batch_start")
        self._start_timer()

    def _is_sampled(self, batch_index: int) -> bool:
        after_warmup = batch_index - self.warmup_steps
        return after_warmup >= 0 and after_warmup % self.every_n_steps == 0

    def _preroll(self) -> None:
        """Start the CPU meter's region before the batch it meters (see ``lightning_tbp.memory.stages``):
        at the previous batch's backward, so the gradients allocated there are known to the
        profiler when the metered batch frees them."""
        assert self._meter is not None
        if self._sampling or self._meter.active or not self._meter.needs_preroll:
            return
        if self._is_sampled(self._batch_index + 1):
            self._meter.begin()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._sampling:
            self._mark(trainer, pl_module, "after_forward")
        else:
            self._preroll()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._sampling:
            self._mark(trainer, pl_module, "after_backward")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._stop_timer()
        if not self._sampling:
            self._preroll()  # a batch that skipped its backward (a DP batch with no samples)
            return
        assert self._meter is not None
        self._mark(trainer, pl_module, "after_step")
        snapshots = self._snapshots_of(self._meter.end())
        self._snapshots.extend(snapshots)
        self._sampling = False
        self._preroll()  # every_n_steps=1: the next batch is metered too
        if self.log_metrics and trainer.loggers:
            metrics = {f"memory/{s.stage}_mb": s.current_bytes / 2**20 for s in snapshots}
            metrics["memory/peak_mb"] = max(s.peak_bytes for s in snapshots) / 2**20
            metrics["memory/activations_mb"] = max(s.breakdown.activations for s in snapshots) / 2**20
            metrics["memory/rss_mb"] = snapshots[-1].rss_bytes / 2**20
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _mark(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        assert self._meter is not None
        stats = trainer.strategy.dp_buffer_stats() if isinstance(trainer.strategy, MemoryReportingStrategy) else None
        dp_now = 0 if stats is None else stats.current_bytes
        tracked = tensor_bytes(pl_module, trainer.optimizers, self._device, dp_buffers=dp_now)
        dp_peak = None if stats is None else stats.peak_bytes if stage == "after_backward" else dp_now
        self._pending.append((stage, time.perf_counter() - self._fit_started, trainer.global_step, tracked, dp_peak))
        self._meter.mark(stage)

    def _snapshots_of(self, readings: list[Any]) -> list[Snapshot]:
        assert self._meter is not None
        # CPU readings count from the batch's start: put the tracked bytes of that moment under them.
        # (and the strategy's communication buffers, which no tensor it tracks accounts for)
        offset = 0 if self._meter.absolute else self._pending[0][3].tracked + self._held_beside
        start_current = readings[0].current_bytes + offset
        start_tracked = self._pending[0][3].tracked
        snapshots = []
        for (stage, at, global_step, tracked, dp_peak), reading in zip(self._pending, readings, strict=True):
            current = reading.current_bytes + offset
            snapshots.append(
                Snapshot(
                    step=self._batch_index,
                    global_step=global_step,
                    stage=stage,
                    time_s=at,
                    current_bytes=current,
                    peak_bytes=reading.peak_bytes + offset,
                    rss_bytes=reading.rss_bytes,
                    reserved_bytes=reading.reserved_bytes,
                    peak_reserved_bytes=reading.peak_reserved_bytes,
                    breakdown=split_untracked(current, tracked, start_current, start_tracked),
                    dp_peak_bytes=dp_peak,
                )
            )
        self._pending = []
        return snapshots

    # -- step time: every batch after the warm-up, except CPU batches slowed by the meter ------

    def _start_timer(self) -> None:
        if self._device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._step_started = event
        else:
            self._step_started = time.perf_counter()

    def _stop_timer(self) -> None:
        started, self._step_started = self._step_started, None
        if started is None or self._batch_index < self.warmup_steps:
            return
        if isinstance(started, torch.cuda.Event):
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            self._cuda_events.append((started, ended))  # read at the end: no synchronisation per step
        else:
            # CPU batches run inside the meter's profiler are slower: time them apart.
            metered = self._sampling or (self._meter is not None and self._meter.active)
            times = self._metered_step_times if metered else self._step_times
            times.append(time.perf_counter() - started)

    # -- results ---------------------------------------------------------------------------

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._meter is not None and self._meter.active:
            self._meter.abort()  # training ended during a pre-roll batch
        self._stop_history(trainer)
        path = self._write(trainer, pl_module)
        if trainer.is_global_zero:
            assert self.record is not None
            rank_zero_info(f"{format_stage_table(self.record)}\n  written to {path}")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._meter is not None:
            self._meter.abort()
        self._sampling = False
        if isinstance(exception, torch.OutOfMemoryError) and self._device.type == "cuda" and self._ready:
            assert self.output_dir is not None  # set in setup
            path = self.output_dir / f"oom_snapshot_rank{trainer.global_rank}.pickle"
            dump_cuda_memory_snapshot(str(path))
            print(f"MemoryProfilerCallback: CUDA out of memory; allocator snapshot written to {path}", flush=True)
        self._stop_history(trainer)
        if self._ready:
            self._write(trainer, pl_module)

    def _stop_history(self, trainer: pl.Trainer) -> None:
        if not self._history_on:
            return
        assert self.output_dir is not None
        path = self.output_dir / f"memory_history_rank{trainer.global_rank}.pickle"
        dump_cuda_memory_snapshot(str(path))
        stop_cuda_memory_history()
        self._history_on = False
        rank_zero_info(
            f"MemoryProfilerCallback: CUDA memory history written to {path} (open in pytorch.org/memory_viz)"
        )

    def _write(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Path:
        assert self.output_dir is not None
        if self._cuda_events:
            torch.cuda.synchronize(self._device)
            self._step_times.extend(start.elapsed_time(end) / 1e3 for start, end in self._cuda_events)
            self._cuda_events = []
        # Only when every timed CPU batch was metered, the (slower) metered times are all there is.
        timing_includes_meter = not self._step_times and bool(self._metered_step_times)
        strategy_name = getattr(trainer.strategy, "strategy_name", None) or type(trainer.strategy).__name__
        self.record = build_run_record(
            experiment=self.experiment or f"{type(pl_module).__name__}-{strategy_name}",
            config=self._config(trainer, pl_module, strategy_name),
            snapshots=self._snapshots,
            step_times_s=self._metered_step_times if timing_includes_meter else self._step_times,
            timing_includes_meter=timing_includes_meter,
            device=str(self._device),
            meter=self._meter.name if self._meter is not None else "none",
            rank=trainer.global_rank,
            world_size=trainer.world_size,
        )
        return write_run_record(self.record, self.output_dir / f"memory_rank{trainer.global_rank}.json")

    def _config(self, trainer: pl.Trainer, pl_module: pl.LightningModule, strategy_name: str) -> dict[str, Any]:
        params = list(pl_module.parameters())
        config: dict[str, Any] = {
            "model": type(pl_module).__name__,
            "parameters": sum(p.numel() for p in params),
            "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
            "model_size_mb": sum(p.numel() * p.element_size() for p in params) / 2**20,
            "batch_size": self._batch_size,
            "precision": str(trainer.precision),
            "strategy": strategy_name,
            "devices": trainer.num_devices,
            "num_nodes": trainer.num_nodes,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "every_n_steps": self.every_n_steps,
            "warmup_steps": self.warmup_steps,
            "plan": None,
            "dp": None,
        }
        if isinstance(trainer.strategy, MemoryReportingStrategy):
            config.update(trainer.strategy.memory_report_config())
        return config
