"""Measured CPU allocator peaks (exact, from the profiler's allocation events) against the plan."""

import gc
import itertools
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import CASES, feasible_range, make_case, parameter_bytes

from lightning_tbp import rematerialize
from lightning_tbp.memory import allocator_peak, measure_peak
from lightning_tbp.memory.meters import collect_garbage_made_inside, known_to_the_meter
from lightning_tbp.remat import Option, Simulator, record_trace
from lightning_tbp.remat.apply import InstalledWrappers


def measured_step_peak(model, case, args, kwargs) -> int:
    model.zero_grad(set_to_none=True)

    def step() -> None:
        out = case.output(model(*args, **kwargs))
        out.float().pow(2).mean().backward()

    step()  # warm-up: one-time allocations (e.g. oneDNN caches) stay out of the measurement
    model.zero_grad(set_to_none=True)
    return measure_peak(step).peak_bytes


@pytest.mark.parametrize("case", [c for c in CASES if c.name != "dit_dropout"], ids=lambda c: c.name)
def test_measured_peak_matches_prediction_and_respects_budget(case) -> None:
    model, args, kwargs = make_case(case)
    naive_measured = measured_step_peak(model, case, args, kwargs)
    lowest, naive = feasible_range(model, args, kwargs)
    for budget in ((lowest + 3 * naive) // 4, (lowest + naive) // 2, lowest):
        plan = rematerialize(model, *args, memory_budget=budget, **kwargs)
        shape_plan = plan.current
        measured = measured_step_peak(model, case, args, kwargs)
        plan.remove()
        assert abs(measured / shape_plan.predicted_peak_bytes - 1) <= 0.10, (budget, measured, shape_plan)
        assert measured <= shape_plan.budget_bytes
        assert measured < naive_measured


def test_peak_really_drops_on_the_unet() -> None:
    """The point of the project: the executed plan lowers the real allocator peak a lot."""
    case = next(c for c in CASES if c.name == "unet2d_attention")
    model, args, kwargs = make_case(case)
    naive = measured_step_peak(model, case, args, kwargs)
    lowest, naive_predicted = feasible_range(model, args, kwargs)
    assert abs((naive_predicted - parameter_bytes(model)) / naive - 1) <= 0.10, "the naive prediction must match too"
    plan = rematerialize(model, *args, memory_budget=lowest, **kwargs)
    planned = measured_step_peak(model, case, args, kwargs)
    plan.remove()
    assert planned <= lowest
    assert planned < 0.55 * naive


@pytest.mark.parametrize("case", [c for c in CASES if c.name != "dit_dropout"], ids=lambda c: c.name)
@pytest.mark.parametrize("option", [Option.LAZY, Option.SELECTIVE, Option.FULL])
def test_each_block_option_is_predicted(case, option) -> None:
    """The replay models each mechanism, not only the mixes the solver happens to choose."""
    model, args, kwargs = make_case(case)
    trace = record_trace(model, args, kwargs)
    simulator = Simulator(trace)
    leaves = [n.index for n in trace.nodes[1:] if not n.children and n.has_events]
    options = [Option.KEEP] * len(trace.nodes)
    for i in leaves:
        options[i] = option
    predicted = simulator.run(options).peak_bytes
    wrapped = {trace.nodes[i].path: option for i in leaves}
    wrappers = InstalledWrappers(model, wrapped, {trace.nodes[i].path: simulator.cache_limit(i) for i in leaves})
    wrappers.ensure(wrapped)
    measured = measured_step_peak(model, case, args, kwargs)
    wrappers.remove()
    assert abs(measured / predicted - 1) <= 0.10
    assert measured < simulator.run([Option.KEEP] * len(trace.nodes)).peak_bytes


def test_cpu_meter_refuses_to_nest_in_a_running_profiler() -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]), pytest.raises(RuntimeError, match="already running"):
        measure_peak(lambda: None)


def test_blocks_made_known_to_the_meter_count_when_a_later_region_frees_them() -> None:
    """The free of a block allocated outside every region is not seen (the level would stay too
    high by its size); one made inside ``known_to_the_meter`` is."""
    nbytes = 4 * 2**20
    unknown = torch.empty(nbytes, dtype=torch.uint8)
    with known_to_the_meter("cpu"):
        known = torch.empty(nbytes, dtype=torch.uint8)
    with allocator_peak("cpu") as freeing_unknown:
        del unknown
    with allocator_peak("cpu") as freeing_known:
        del known
    assert freeing_unknown.net_bytes == 0
    assert freeing_known.net_bytes == -nbytes


def test_cpu_meter_holds_the_collector_off_and_collects_only_what_its_region_made() -> None:
    """Why: the profiler reports the free of a block an earlier session saw allocated, so garbage
    collected inside a region would lower its count. So the meter holds the collector off inside
    it, after a young collection only (a full one costs a small model's metered step ~0.4 s):
    old garbage stays until after the region, and ``collect_garbage_made_inside`` frees the
    region's own cycles and nothing older."""
    kept = []
    with allocator_peak():
        kept.append(torch.empty(1 << 20))  # 4 MiB, seen allocated in this session
    with allocator_peak() as later:
        kept.clear()
    assert later.net_bytes == -(4 << 20)  # the fact that makes stray collections matter

    class Cycle:
        pass

    old = Cycle()
    old.itself = old
    gc.collect()  # promoted out of the youngest generation while still reachable
    old_alive = weakref.ref(old)
    del old  # now old garbage
    with allocator_peak():
        assert old_alive() is not None, "no full collection before the region"
        assert not gc.isenabled(), "no collection inside the region"
        young = Cycle()
        young.itself = young
        young_alive = weakref.ref(young)
        del young
        collect_garbage_made_inside()
        assert young_alive() is None and old_alive() is not None
    assert gc.isenabled()
    gc.collect()
    assert old_alive() is None


_EVENTS = st.lists(
    st.one_of(st.tuples(st.just("alloc"), st.integers(1, 1 << 16)), st.just(("free",)), st.just(("mark",))),
    max_size=24,
)


@settings(max_examples=25, deadline=None)
@given(events=_EVENTS)
def test_marks_split_a_region_into_windows_with_exact_levels_and_peaks(events) -> None:
    """A plan's meter splits a step at its module's forward end and at its outputs' first
    gradient, to measure the loss between them: for any sequence of allocations, frees and
    marks, each mark gives the level there and the peak since the previous mark to the byte,
    and the region's own peak and net are those of the whole sequence."""
    held: list[torch.Tensor] = []
    level = peak = window = 0
    expected = []
    with allocator_peak() as reading:
        for event in events:
            if event[0] == "alloc":
                held.append(torch.empty(event[1], dtype=torch.uint8))
                level += event[1]
                peak, window = max(peak, level), max(window, level)
            elif event[0] == "free" and held:
                level -= held.pop(0).numel()
            elif event[0] == "mark":
                reading.mark()
                expected.append((level, window))
                window = level
        held.clear()
    assert [(m.level_bytes, m.peak_before_bytes) for m in reading.marks] == expected
    assert (reading.peak_bytes, reading.net_bytes) == (peak, 0)


_NESTED = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 1 << 16)),
        st.just(("free",)),
        st.just(("open",)),
        st.tuples(st.just("close"), st.integers(0, 3)),
        st.tuples(st.just("mark"), st.integers(0, 3)),
    ),
    max_size=30,
)


@settings(max_examples=25, deadline=None)
@given(events=_NESTED)
def test_regions_nest_and_overlap_exactly(events) -> None:
    """A metered training step contains the planner's metered ops, and a test meters a whole fit
    that contains metered steps: any number of regions, opened and closed in any order, each get
    the peak, net and marks of the allocations made while they were open, to the byte. (A block
    allocated while no region is open is never freed inside one here: the profiler cannot see
    such a free, a documented limit of the meter.)"""
    import contextlib

    held: list[tuple[torch.Tensor, bool]] = []  # and whether a session saw it allocated
    level = 0
    open_regions: list[tuple[contextlib.ExitStack, object, dict]] = []
    checked: list[tuple[object, dict]] = []

    def close(index: int) -> None:
        stack, reading, expected = open_regions.pop(index)
        stack.close()
        expected["net"] = level - expected["start"]
        checked.append((reading, expected))

    for event in events:
        if event[0] == "alloc":
            held.append((torch.empty(event[1], dtype=torch.uint8), bool(open_regions)))
            level += event[1]
            for _, _, expected in open_regions:
                expected["peak"] = max(expected["peak"], level)
                expected["window"] = max(expected["window"], level)
        elif event[0] == "free" and held and (held[0][1] or not open_regions):
            level -= held.pop(0)[0].numel()
        elif event[0] == "open":
            stack = contextlib.ExitStack()
            reading = stack.enter_context(allocator_peak())
            open_regions.append((stack, reading, {"start": level, "peak": level, "window": level, "marks": []}))
        elif event[0] == "close" and open_regions:
            close(event[1] % len(open_regions))
        elif event[0] == "mark" and open_regions:
            _, reading, expected = open_regions[event[1] % len(open_regions)]
            reading.mark()
            expected["marks"].append((level - expected["start"], expected["window"] - expected["start"]))
            expected["window"] = level
    while open_regions:
        close(-1)
    held.clear()
    for reading, expected in checked:
        assert reading.peak_bytes == expected["peak"] - expected["start"]
        assert reading.net_bytes == expected["net"]
        assert [(m.level_bytes, m.peak_before_bytes) for m in reading.marks] == expected["marks"]
    assert gc.isenabled()


def test_the_meter_keeps_torchs_profiler_chatter_off_stderr_and_nothing_else(capfd) -> None:
    """torch 2.13's profiler prints two USDT lines per session and a CPUAllocator warning for
    a block from outside the session freed inside it, straight to descriptor 2; the meter drops
    exactly those, and what else is written meanwhile (Python or native) comes through in order."""
    import os
    import sys

    old = torch.ones(1 << 10)  # allocated outside any session: its free inside makes the warning
    with allocator_peak():
        print("python line", file=sys.stderr, flush=True)
        del old
        os.write(2, b"native line\n")
        with allocator_peak():  # a nested region restarts the session: two more USDT lines
            os.write(2, b"partial ")
        os.write(2, b"line\n\rprogress 50%")
    err = capfd.readouterr().err
    assert err == "python line\nnative line\npartial line\n\rprogress 50%"


_CHATTER_LINES = [
    b"USDT:2026-11-26 21:33:37 1993:1993 SyncActivityProfilerHandler.cpp:52] profiler_start\n",
    b"[W1126 21:52:28.134466179 profiler_kineto.cpp:814] Toggling CPU activity with GPU activity on may result in "
    b"traces with GPU events on arbitrary tracks\n",
    b"[W1126 21:33:37.274944199 CPUAllocator.cpp:245] Memory block of unknown size was allocated before the "
    b"profiling started, profiler results will not include the deallocation event\n",
    # in a process of a distributed group torch puts the rank first
    b"[rank0]:[W1130 03:50:23.052000199 profiler_kineto.cpp:814] Toggling CPU activity with GPU activity on may "
    b"result in traces with GPU events on arbitrary tracks\n",
    b"[rank1]:USDT:2026-11-30 03:50:23 1131:1131 SyncActivityProfilerHandler.cpp:52] profiler_stop\n",
]


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            st.binary(max_size=12),
            st.sampled_from([b"\n", b"\r", b"[W", b"US", b"USDT: not chatter\n", b"[rank", b"[rank0]: not chatter\n"]),
        ),
        max_size=12,
    ),
    chatter_at=st.lists(st.tuples(st.integers(0, 12), st.integers(0, len(_CHATTER_LINES) - 1)), max_size=4),
    cuts=st.lists(st.integers(0, 400), max_size=6),
)
def test_the_chatter_filter_passes_every_other_byte_through_wherever_the_stream_is_cut(pieces, chatter_at, cuts):
    """Whatever else is written (partial lines, carriage returns, text that starts like chatter)
    and wherever torch's chatter lands between writes, and however the pipe cuts the stream into
    reads, exactly the other bytes come out, in order."""
    from lightning_tbp.memory.native_stderr import ChatterStripper

    wanted = b"".join(pieces)
    stream = list(pieces)
    for at, which in sorted(chatter_at, reverse=True):
        stream.insert(min(at, len(stream)), _CHATTER_LINES[which])
    data = b"".join(stream)
    stripper = ChatterStripper()
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    out = b"".join(stripper.feed(data[a:b]) for a, b in itertools.pairwise(bounds)) + stripper.end()
    assert out == wanted
