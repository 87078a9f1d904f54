"""``MemoryProfilerCallback``: exact stage meters, a breakdown that adds up, JSON, plots, errors."""

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from matplotlib.image import imread
from models import Denoiser
from torch.utils.data import DataLoader, TensorDataset

from lightning_tbp import MemoryProfilerCallback, TinyBackpropStrategy
from lightning_tbp.cli import main as tbp_main
from lightning_tbp.memory.record import BREAKDOWN_KEYS, REQUIRED_KEYS
from lightning_tbp.memory.report import compare_runs
from lightning_tbp.memory.stages import CpuStageMeter

MiB = 2**20
STAGES = ["batch_start", "after_forward", "after_backward", "after_step"]


class CountBatches(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, *args) -> None:
        self.batches += 1


def fit_with_profiler(tmp_path: Path, strategy="auto", max_steps: int = 5, **callback_kwargs) -> dict:
    torch.manual_seed(0)
    data = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    callback = MemoryProfilerCallback(**{"every_n_steps": 1, "warmup_steps": 2, **callback_kwargs})
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=CSVLogger(tmp_path, name="logs"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        log_every_n_steps=1,
    )
    model = Denoiser()
    trainer.fit(model, DataLoader(TensorDataset(data), batch_size=4))
    assert callback.record is not None
    return {"record": callback.record, "model": model, "trainer": trainer, "callback": callback}


@pytest.fixture(scope="module")
def naive_run(tmp_path_factory) -> dict:
    return fit_with_profiler(tmp_path_factory.mktemp("naive"), experiment="naive")


@pytest.fixture(scope="module")
def planned_run(tmp_path_factory) -> dict:
    return fit_with_profiler(
        tmp_path_factory.mktemp("planned"), TinyBackpropStrategy(memory_budget=0.5), experiment="tiny_backprop"
    )


def test_cpu_stage_meter_is_exact() -> None:
    meter = CpuStageMeter()
    meter.begin()
    held = torch.empty(MiB // 4)  # allocated in the pre-roll: its free is visible
    meter.mark("start")
    x = torch.empty(MiB // 4)
    meter.mark("one")
    y = torch.empty(MiB // 2)  # 2 MiB
    del x, held
    meter.mark("two")
    readings = meter.end()
    del y
    assert [(r.stage, r.current_bytes, r.peak_bytes) for r in readings] == [
        ("start", 0, 0),
        ("one", MiB, MiB),
        ("two", MiB, 3 * MiB),  # x + y at the peak; then x and the pre-roll's tensor are freed
    ]
    assert all(r.rss_bytes > 0 for r in readings)
    assert not meter.active


def test_tracked_bytes_equal_the_model_tensors(naive_run) -> None:
    model = naive_run["model"]
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    adam_bytes = 2 * param_bytes + 4 * len(params)  # exp_avg, exp_avg_sq, and a float32 step per tensor
    snapshots = naive_run["record"]["snapshots"]
    assert [s["stage"] for s in snapshots[:4]] == STAGES
    for snap in snapshots:
        b = snap["breakdown"]
        assert b["parameters_mb"] * MiB == param_bytes
        assert b["optimizer_state_mb"] * MiB == adam_bytes
        # Lightning sets gradients to None after the forward, before the backward.
        assert b["gradients_mb"] * MiB == (0 if snap["stage"] == "after_forward" else param_bytes)
        assert sum(b[key] for key in BREAKDOWN_KEYS) == pytest.approx(snap["current_mb"])
        assert snap["peak_mb"] >= snap["current_mb"]


def test_activations_drop_with_the_plan(naive_run, planned_run) -> None:
    def after_forward(record: dict) -> list[float]:
        return [s["breakdown"]["activations_mb"] for s in record["snapshots"] if s["stage"] == "after_forward"]

    naive, planned = after_forward(naive_run["record"]), after_forward(planned_run["record"])
    assert len(naive) == len(planned) == 3  # batches 2, 3, 4 after two warm-up batches
    assert min(naive) > 10  # the tiny U-Net at batch 4 saves tens of MiB
    assert max(planned) < 0.6 * min(naive)
    assert planned_run["record"]["peak_memory_mb"] < 0.85 * naive_run["record"]["peak_memory_mb"]


def test_run_record_schema_and_logged_metrics(planned_run) -> None:
    record, trainer = planned_run["record"], planned_run["trainer"]
    path = Path(trainer.log_dir) / "memory" / "memory_rank0.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(record))
    assert set(REQUIRED_KEYS) <= set(record)
    assert record["experiment"] == "tiny_backprop" and record["world_size"] == 1 and record["rank"] == 0
    config = record["config"]
    assert config["batch_size"] == 4 and config["strategy"] == "tiny_backprop" and config["precision"] == "32-true"
    assert config["parameters"] == sum(p.numel() for p in planned_run["model"].parameters())
    assert config["plan"]["predicted_peak_bytes"] > 0 and config["dp"] is None
    assert set(record["breakdown"]) == set(BREAKDOWN_KEYS)
    assert record["peak_memory_mb"] == max(s["peak_mb"] for s in record["snapshots"])
    assert record["avg_time_ms"] > 0 and record["timed_steps"] == 3
    metrics = (Path(trainer.log_dir) / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"memory/peak_mb", "memory/activations_mb", "memory/after_forward_mb"} <= set(metrics)


def test_sampling_options_choose_the_metered_batches(tmp_path) -> None:
    run = fit_with_profiler(tmp_path, max_steps=7, every_n_steps=3, warmup_steps=2, log_metrics=False)
    record = run["record"]
    assert sorted({s["step"] for s in record["snapshots"]}) == [2, 5]
    # Batches 2 and 5 are metered, and 1 and 4 start the profiler at their backward: 3 and 6 are clean.
    assert record["timed_steps"] == 2 and not record["timing_includes_meter"]


def test_report_writes_plots_and_summary(naive_run, planned_run, tmp_path) -> None:
    paths = []
    for run in (naive_run, planned_run):
        paths.append(tmp_path / f"{run['record']['experiment']}.json")
        paths[-1].write_text(json.dumps(run["record"]))
    files = compare_runs(paths, tmp_path / "report")
    for png in (files.breakdown, files.timeline, files.tradeoff):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = imread(png)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0
    summary = files.summary.read_text()
    assert "naive" in summary and "tiny_backprop" in summary and "after_forward" in summary

    assert tbp_main(["report", *map(str, paths), "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "memory_timeline.png").stat().st_size > 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"experiment": "x"}))
    assert tbp_main(["report", str(bad)]) == 2
    with pytest.raises(ValueError, match="missing config"):
        compare_runs([bad], tmp_path / "never")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": -1}, "every_n_steps must be an int >= 1"),
        ({"every_n_steps": 0}, "every_n_steps must be an int >= 1"),
        ({"warmup_steps": -2}, "warmup_steps must be an int >= 0"),
        ({"every_n_steps": 2.5}, "every_n_steps must be an int >= 1"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryProfilerCallback(**kwargs)


def test_unwritable_directory_fails_before_training(tmp_path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    counter = CountBatches()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[MemoryProfilerCallback(output_dir=blocker / "memory"), counter],
    )
    data = DataLoader(TensorDataset(torch.randn(4, 3, 32, 32)), batch_size=2)
    with pytest.raises(ValueError, match="cannot write to output_dir"):
        trainer.fit(Denoiser(), data)
    assert counter.batches == 0


@pytest.mark.slow
def test_two_process_ddp_writes_one_record_per_rank(tmp_path) -> None:
    script = Path(__file__).parent / "scripts" / "ddp_memory_profile.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads((tmp_path / "memory" / f"memory_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in records] == [0, 1]
    for record in records:
        assert record["world_size"] == 2 and record["config"]["strategy"] == "DDPStrategy"
        assert [s["stage"] for s in record["snapshots"][:4]] == STAGES
        assert record["breakdown"]["activations_mb"] > 0


def test_the_batch_that_makes_the_plan_can_be_metered_too(tmp_path, recwarn) -> None:
    """The meters nest: the callback meters the planning batch while the planner meters its ops
    and the strategy its step, and neither gives up what it measures."""
    run = fit_with_profiler(tmp_path, TinyBackpropStrategy(memory_budget=0.5), max_steps=2, warmup_steps=0)
    snapshots = run["record"]["snapshots"]
    assert [s["step"] for s in snapshots] == [0] * 4 + [1] * 4
    assert not [w for w in recwarn if "profiler" in str(w.message)]
    checked = run["trainer"].strategy.plan.current
    assert checked.measured_peak_bytes is not None
    assert checked.measured_peak_bytes <= checked.budget_bytes
