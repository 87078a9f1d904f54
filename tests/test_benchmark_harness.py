"""The benchmark harness itself (arguments, JSON records, search and threshold logic), not its figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import dp_plan_time
import hfu
import high_res
import host_tier
import unet_mem_bench
import verify
from cases import build_case, get_profile
from common import grads_of
from methods import EveryKthCheckpoint, parse_mode, parse_modes

from lightning_tbp.remat import priced_by_flops


@pytest.mark.parametrize(
    ("spec", "kind", "value"),
    [
        ("naive", "naive", None),
        ("diffusers", "diffusers", None),
        ("diffusers_every:3", "diffusers_every", 3),
        ("compile:0.5", "compile", 0.5),
        ("tbp:0.4", "tbp", 0.4),
        ("tbp:6GiB", "tbp", "6GiB"),
        ("tbp:lowest", "tbp", "lowest"),
        ("tbp:at:diffusers", "tbp", "at:diffusers"),
    ],
)
def test_modes_parse(spec, kind, value) -> None:
    mode = parse_mode(spec)
    assert (mode.spec, mode.kind, mode.value) == (spec, kind, value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("bogus", "unknown mode"),
        ("naive:1", "takes no value"),
        ("tbp", "needs a value"),
        ("diffusers_every:1", "K >= 2"),
        ("compile:1.5", "in \\(0, 1\\]"),
        ("compile:x", "in \\(0, 1\\]"),
        ("tbp:lots", "not valid"),
        ("tbp:at:bogus", "unknown mode"),
    ],
)
def test_malformed_modes_are_named(spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_mode(spec)


def test_argument_errors_exit_with_usage(capsys) -> None:
    for main_parse, argv in [
        (unet_mem_bench.parse_args, ["--modes", "tbp:2GB", "bogus"]),
        (unet_mem_bench.parse_args, ["--trials", "0"]),
        (unet_mem_bench.parse_args, ["--size", "4"]),
        (high_res.parse_args, ["--cap", "0.5"]),
        (high_res.parse_args, ["--cap", "64MiB", "--modes", "tbp:0.5"]),
        (hfu.parse_args, ["--modes", "tbp:0.7"]),
        (hfu.parse_args, ["--peak-tflops", "-1"]),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main_parse(argv)
        assert exit_info.value.code == 2, argv
    assert "unknown mode 'bogus'" in capsys.readouterr().err


def test_mode_lists_are_checked() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        parse_modes(["naive", "naive"])
    with pytest.raises(ValueError, match="must be listed before it"):
        parse_modes(["tbp:at:diffusers", "diffusers"])


def test_bisection_finds_the_largest_fitting_multiple() -> None:
    calls = []

    def fits_up_to(limit):
        def fits(value):
            calls.append(value)
            return value <= limit

        return fits

    assert high_res.largest_fitting(fits_up_to(37), 8, 1024) == 32
    assert high_res.largest_fitting(fits_up_to(5000), 8, 1024) == 1024
    assert high_res.largest_fitting(fits_up_to(4), 8, 1024) == 0
    assert high_res.largest_fitting(fits_up_to(19), 1, 256) == 19
    calls.clear()
    high_res.largest_fitting(fits_up_to(300), 8, 1024)
    assert len(calls) <= 12, "doubling and bisection, not a scan of 38 sizes"


def test_every_kth_checkpoint_is_exact_and_checkpoints_fewer_blocks() -> None:
    case = build_case(get_profile("small", size=16, batch=2), torch.device("cpu"))
    case.step()
    reference = grads_of(case.model)
    every = EveryKthCheckpoint(2)
    case.model.enable_gradient_checkpointing(every)
    case.model.zero_grad(set_to_none=True)
    case.step()
    case.model.disable_gradient_checkpointing()
    assert len(every.order) >= 4
    for name, grad in grads_of(case.model).items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-7)


REQUIRED_MACHINE = {"torch", "cuda", "git_commit", "cpu_count", "python"}


@pytest.mark.slow
def test_unet_mem_bench_writes_its_json_and_plot(tmp_path) -> None:
    argv = ["--trials", "1"]  # the small profile: diffusers peaks above the lowest plan there
    argv += ["--modes", "naive", "diffusers", "tbp:lowest", "tbp:at:diffusers", "tbp:1KiB", "tbp:at:tbp:1KiB"]
    unet_mem_bench.main([*argv, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "unet_mem_small.json").read_text())
    assert (tmp_path / "unet_mem_small.png").stat().st_size > 0
    assert result["experiment"] == "unet_mem_bench" and set(result["machine"]) >= REQUIRED_MACHINE
    assert result["config"]["size"] == 32 and result["config"]["batch"] == 4
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == ["naive", "diffusers", "tbp:lowest", "tbp:at:diffusers", "tbp:1KiB", "tbp:at:tbp:1KiB"]
    assert rows["tbp:at:diffusers"]["budget_bytes"] == rows["diffusers"]["peak_bytes"]
    assert "InfeasibleBudgetError" in rows.pop("tbp:1KiB")["error"]  # a failed mode is a row, the run goes on
    assert "has no measured peak" in rows.pop("tbp:at:tbp:1KiB")["error"]
    for row in rows.values():
        assert {
            "peak_bytes",
            "activation_peak_bytes",
            "step_seconds",
            "flops",
            "grad_max_rel_diff",
            "peak_ratio",
        } <= set(row)
        assert row["grad_max_rel_diff"] == 0.0
    assert rows["naive"]["peak_ratio"] == 1.0
    assert "predicted_peak_bytes" in rows["tbp:lowest"]


@pytest.mark.slow
def test_high_res_and_hfu_write_their_json(tmp_path) -> None:
    high_res.main(["--cap", "40MiB", "--max-size", "32", "--max-batch", "4", "--modes", "naive", "tbp",
                   "--out", str(tmp_path / "hr")])  # fmt: skip
    result = json.loads((tmp_path / "hr" / "high_res_small.json").read_text())
    assert set(result["machine"]) >= REQUIRED_MACHINE and result["config"]["cap_bytes"] == 40 * 2**20
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"naive", "tbp"} and all(r["max_size"] % 8 == 0 for r in rows.values())
    assert all(p["peak_bytes"] <= 40 * 2**20 for p in result["probes"] if p["fits"])
    hfu.main(["--size", "16", "--batches", "1", "--trials", "1", "--modes", "naive", "tbp:lowest",
              "--out", str(tmp_path / "hfu")])  # fmt: skip
    result = json.loads((tmp_path / "hfu" / "hfu_small.json").read_text())
    assert result["peak_flops"] > 0 and result["peak_source"]
    naive, planned = result["rows"]
    assert naive["hfu"] == pytest.approx(naive["mfu"])
    assert planned["model_flops"] == naive["hardware_flops"] and planned["hardware_flops"] >= naive["hardware_flops"]


@pytest.mark.slow
def test_dp_plan_time_holds_budgets_and_keeps_gradients(tmp_path) -> None:
    # priced by FLOPs, so that a failure replays with its plan: with measured prices one CI run
    # drew a bookkeeping plan predicted 10% over its measured peak (not reproduced here)
    with priced_by_flops():
        dp_plan_time.main(["--trials", "1", "--warmup", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "dp_plan_time_dit.json").read_text())
    assert set(result["machine"]) >= REQUIRED_MACHINE
    rows = result["rows"]
    assert [(r["mode"], r["plan_budget"]) for r in rows] == [
        (mode, budget) for mode in ("vanilla", "ghost", "bookkeeping") for budget in (None, 0.5)
    ]
    for row in rows:
        assert row["grad_max_rel_diff"] < 1e-5, row
        if row["plan_budget"] is not None:
            assert row["measured_over_budget"] <= 1.0 and abs(row["measured_over_predicted"] - 1) <= 0.05, row


RESULT = {
    "rows": [
        {"mode": "naive", "batch": 4, "peak_bytes": 100, "step_seconds": 1.0},
        {"mode": "tbp:0.7", "batch": 4, "peak_bytes": 40, "step_seconds": 1.1},
        {"mode": "naive", "batch": 8, "peak_bytes": 200, "step_seconds": 2.0},
        {"mode": "tbp:0.7", "batch": 8, "peak_bytes": 120, "step_seconds": 2.1},
        {"mode": "compile:0.5", "batch": 4, "error": "OutOfMemoryError: ..."},
    ]
}


def check(**fields):
    return {"name": "c", "benchmark": "b", "select": {"mode": "tbp:0.7"}, "metric": "peak_bytes", **fields}


def test_thresholds_pass_fail_and_relative() -> None:
    assert verify.evaluate(check(max=120), RESULT).passed
    failed = verify.evaluate(check(max=100), RESULT)
    assert not failed.passed and "120 > 100" in failed.reason
    relative = verify.evaluate(check(relative_to="naive", max=0.6), RESULT)  # 40/100 and 120/200
    assert relative.passed and relative.values == [0.4, 0.6]
    assert not verify.evaluate(check(relative_to="naive", max=0.5), RESULT).passed
    batch8 = verify.evaluate(check(select={"mode": "tbp:0.7", "batch": 8}, relative_to="naive", min=0.6), RESULT)
    assert batch8.passed and batch8.values == [0.6]


def test_thresholds_fail_on_missing_or_errored_rows() -> None:
    assert "no row matches" in verify.evaluate(check(select={"mode": "tbp:0.1"}, max=1), RESULT).reason
    errored = verify.evaluate(check(select={"mode": "compile:0.5"}, max=1e9), RESULT)
    assert not errored.passed and "OutOfMemoryError" in errored.reason
    assert not verify.evaluate(check(max=1), None).passed
    assert not verify.evaluate(check(relative_to="diffusers", max=1), RESULT).passed  # no reference row


def test_verify_config_is_checked_before_running(tmp_path) -> None:
    verify.load_config(verify.DEFAULT_CONFIG)  # the shipped one is valid
    bad = tmp_path / "bad.yaml"
    for text, message in [
        ("checks: []", "benchmarks"),
        ("benchmarks: {nope: []}", "no benchmark script"),
        ("benchmarks: {hfu: []}\nchecks: [{name: a, benchmark: high_res, select: {}, metric: x, max: 1}]", "not run"),
        ("benchmarks: {hfu: []}\nchecks: [{name: a, benchmark: hfu, select: {}, metric: x}]", "max and/or min"),
        ("benchmarks: {hfu: []}\nchecks: [{name: a, benchmark: hfu, select: {}, metric: x, max: 1, mx: 2}]", "unknown"),
    ]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            verify.load_config(bad)


def test_the_host_tier_benchmark_holds_the_plans_to_the_hand_settings_peaks(tmp_path) -> None:
    host_tier.main(["--names", "dit", "--rounds", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "host_tier.json").read_text())
    assert (tmp_path / "host_tier.png").stat().st_size > 0
    (model,) = result["models"]
    assert [r["setting"].split()[0] for r in model["rows"]] == ["checkpoint", "offload", "checkpoint"]
    for row in model["rows"]:
        if row["plan_below_floor"] is None:
            assert row["plan_budget_bytes"] == row["hand_peak_bytes"]
        else:
            assert row["plan_budget_bytes"] > row["hand_peak_bytes"]
        assert row["plan_peak_bytes"] <= row["plan_budget_bytes"]
        assert row["hand_grad_max_rel_diff"] <= 1e-6 and row["plan_grad_max_rel_diff"] <= 1e-6
    assert model["rows"][1]["hand_host_peak_bytes"] > 0  # offloading every block keeps its saves on the host


def test_the_host_tier_benchmark_with_lora_streams_against_block_swap(tmp_path) -> None:
    host_tier.main(["--names", "flux", "--lora", "4", "--batch", "1", "--rounds", "1", "--out", str(tmp_path)])
    (model,) = json.loads((tmp_path / "host_tier_lora4.json").read_text())["models"]
    assert model["lora_rank"] == 4 and model["parameter_bytes"] > 0
    assert [r["setting"].split()[0] for r in model["rows"]] == ["checkpoint", "stream", "stream"]
    swap_all = model["rows"][1]
    assert swap_all["hand_peak_bytes"] < 0  # every block's weights on the host: below the parameters as loaded
    for row in model["rows"]:
        assert row["plan_peak_bytes"] <= row["plan_budget_bytes"]
        assert row["hand_grad_max_rel_diff"] <= 1e-6 and row["plan_grad_max_rel_diff"] <= 1e-6
