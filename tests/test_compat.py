"""Each private torch API behind ``lightning_tbp.compat`` does what the code relies on.

A torch release that moves or changes one fails here, by name, rather than deep inside a plan or
a DP step.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from processes import run_in_a_gloo_group_of_one
from torch import nn

from lightning_tbp import compat


def test_pytrees_flatten_and_rebuild_nested_arguments() -> None:
    tree = ((torch.ones(1), 2), {"a": [torch.zeros(2)], "b": None})
    leaves, spec = compat.tree_flatten(tree)
    assert len(leaves) == 4 and isinstance(leaves[0], torch.Tensor)
    rebuilt = compat.tree_unflatten(leaves, spec)
    assert rebuilt[1]["a"][0] is tree[1]["a"][0]
    doubled = compat.tree_map(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, tree)
    assert float(doubled[0][0]) == 2.0 and doubled[0][1] == 2


def test_dispatch_modes_see_aten_ops_with_packet_and_schema() -> None:
    seen = []

    class Recorder(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    a, b = torch.ones(2, 2), torch.ones(2, 2)
    with Recorder():
        torch.mm(a, b).t()
    assert isinstance(seen[0], compat.OpOverload)
    assert compat.op_packet(seen[0]) is torch.ops.aten.mm
    transpose = next(op for op in seen if compat.op_packet(op) is torch.ops.aten.t)
    assert compat.op_schema(transpose).returns[0].alias_info is not None  # a view
    assert compat.is_view_op(transpose) and not compat.is_view_op(seen[0])
    assert not compat.is_view_op(torch.ops.aten.add_.Tensor)  # writes its input: not a view
    assert compat.writes_input(torch.ops.aten.add_.Tensor) and compat.writes_input(torch.ops.aten.add.out)
    assert not compat.writes_input(torch.ops.aten._unsafe_view.default) and not compat.writes_input(transpose)


def test_profiler_memory_events_carry_device_types() -> None:
    assert compat.DeviceType.CPU != compat.DeviceType.CUDA


def test_dense_tensors_flatten_into_one_buffer_and_back() -> None:
    tensors = [torch.arange(3.0), torch.ones(2, 2)]
    flat = compat.flatten_dense_tensors(tensors)
    assert flat.shape == (7,)
    back = compat.unflatten_dense_tensors(flat * 2, tensors)
    assert torch.equal(back[1], torch.full((2, 2), 2.0))


def test_leaf_subclasses_share_storage_and_require_grad() -> None:
    class Tagged(torch.Tensor):
        pass

    data = torch.arange(4.0)
    tagged = compat.make_leaf_subclass(Tagged, data, True)
    assert type(tagged) is Tagged and tagged.is_leaf and tagged.requires_grad
    assert tagged.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
    with compat.FakeTensorMode():  # a fake tensor cannot be re-typed: same layout over a meta tensor
        fake = torch.empty(3, 4).t()
        tagged = compat.make_leaf_subclass(Tagged, fake, True)
    assert type(tagged) is Tagged and tagged.is_leaf and tagged.requires_grad
    assert (tagged.shape, tagged.stride(), tagged.dtype) == (fake.shape, fake.stride(), fake.dtype)


def test_foreach_division_in_place() -> None:
    tensors = [torch.full((2,), 4.0), torch.full((3,), 8.0)]
    compat.foreach_div_(tensors, 4.0)
    assert torch.equal(tensors[1], torch.full((3,), 2.0))


def test_conv_layers_run_with_a_given_weight_and_report_their_explicit_padding() -> None:
    conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect")
    x = torch.randn(1, 2, 5, 5)
    torch.testing.assert_close(compat.conv_forward(conv, x, conv.weight, conv.bias), conv(x))
    padded = F.pad(x, compat.conv_explicit_padding(conv), mode="reflect")
    torch.testing.assert_close(F.conv2d(padded, conv.weight, conv.bias), conv(x))


def test_fake_tensors_have_storages_and_fake_modules_convert_dtype_and_deep_copy() -> None:
    """``tbp estimate`` relies on fake tensors' storages (views share one) and, inside
    ``fake_module_support``, on ``Module.to(dtype)`` keeping each fake parameter's identity and
    on ``copy.deepcopy`` of a fake module (an EMA copy) giving new storages in the same mode;
    ``fake_mode_active`` tells a model loader it is inside one."""
    assert not compat.fake_mode_active()
    with compat.FakeTensorMode():
        assert compat.fake_mode_active()
        layer = nn.Linear(3, 3)
        weight = layer.weight
        assert isinstance(weight, compat.FakeTensor)
        assert compat.storage_key(weight.view(-1)) == compat.storage_key(weight) is not None
        with compat.fake_module_support():
            layer.to(torch.bfloat16)
        assert layer.weight is weight and weight.dtype == torch.bfloat16 and weight.requires_grad
    with compat.FakeTensorMode() as mode:
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        with compat.fake_module_support():
            twin = copy.deepcopy(model)
        for original, copied in zip(model.state_dict().values(), twin.state_dict().values(), strict=True):
            assert isinstance(copied, compat.FakeTensor) and copied.fake_mode is mode
            assert compat.storage_key(copied) != compat.storage_key(original)
            assert (copied.shape, copied.stride(), copied.dtype) == (original.shape, original.stride(), original.dtype)
        assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in twin.parameters())
        assert not any(isinstance(b, nn.Parameter) for b in twin.buffers())
        twin(torch.randn(2, 3)).sum().backward()  # tensors of one mode mix
    assert not hasattr(compat.FakeTensor, "__deepcopy__") or compat.FakeTensor.__deepcopy__ is torch.Tensor.__deepcopy__
    swapped_a, swapped_b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.ones(2))
    with compat.fake_module_support():
        torch.utils.swap_tensors(swapped_a, swapped_b)  # real tensors still swap
    assert float(swapped_a.detach().sum()) == 2.0


def test_fake_tensors_raise_the_value_errors_compat_names() -> None:
    """``tbp estimate`` recognises a step that needs tensor values by these exceptions."""
    with compat.FakeTensorMode():
        mask = torch.ones(2, 5, dtype=torch.bool)
        with pytest.raises(compat.FAKE_VALUE_ERRORS):
            mask.sum(dim=1).tolist()
        with pytest.raises(compat.FAKE_VALUE_ERRORS):
            torch.nonzero(mask)


def test_version_counters_count_in_place_writes_and_are_shared_by_detached_views() -> None:
    tensor = torch.zeros(3)
    detached = tensor.detach()
    before = compat.version_counter(tensor)
    tensor.add_(1)
    assert compat.version_counter(tensor) == compat.version_counter(detached) == before + 1
    _ = tensor + 1  # out of place: no write
    assert compat.version_counter(detached) == before + 1


def test_profiler_enabled_sees_any_running_session() -> None:
    from torch.profiler import ProfilerActivity, profile

    assert not compat.profiler_enabled()
    with profile(activities=[ProfilerActivity.CPU]):
        assert compat.profiler_enabled()
    assert not compat.profiler_enabled()


def test_a_memory_event_session_records_allocations_and_marks_and_no_op() -> None:
    """The exact CPU meter's sessions: every allocation and free, marks on the same clock, and no
    op or scope, so a scope open across a session's stop and the next one's start (Lightning's
    closure inside ``Optimizer.step``) is never written into a stopped session's buffer."""
    session = compat.MemoryEventSession()
    with torch.profiler.record_function("user scope"):
        x = torch.ones(256)
        session.mark("the mark")
        del x
    events = session.stop().events()
    assert [e.name() for e in events] == ["[memory]", "the mark", "[memory]"]
    assert [e.nbytes() for e in events if e.name() == "[memory]"] == [1024, -1024]
    assert events[0].device_type() == compat.DeviceType.CPU
    assert not compat.profiler_enabled()


def test_lightning_says_when_it_skips_a_batchs_backward() -> None:
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert compat.lightning_skips_backward(trainer) is False
    trainer.fit_loop._skip_backward = True
    assert compat.lightning_skips_backward(trainer) is True


def test_cuda_memory_history_functions_exist_and_record_on_a_gpu(tmp_path: Path) -> None:
    """The memory callback's history and OOM dump, and peak_breakdown.py, use these; on CPU only
    their presence can be checked (the GPU check runs this file on CUDA)."""
    names = ("_record_memory_history", "_snapshot", "_dump_snapshot")
    assert all(callable(getattr(torch.cuda.memory, name, None)) for name in names)
    if not torch.cuda.is_available():
        return
    compat.record_cuda_memory_history(1000, python_stacks_only=True)
    try:
        block = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        snapshot = compat.cuda_memory_snapshot()
        compat.dump_cuda_memory_snapshot(str(tmp_path / "history.pickle"))
        del block
    finally:
        compat.stop_cuda_memory_history()
    events = [e for trace in snapshot["device_traces"] for e in trace]
    assert any(e["action"] == "alloc" and e["size"] == 1 << 20 for e in events)
    assert (tmp_path / "history.pickle").stat().st_size > 0


def test_cublas_workspaces_can_be_freed_on_a_gpu() -> None:
    """``estimate_check.py`` frees them before measuring a whole fit; on CPU there is nothing to free."""
    if not torch.cuda.is_available():
        assert not hasattr(torch._C, "_cuda_clearCublasWorkspaces") or callable(torch._C._cuda_clearCublasWorkspaces)
        return
    from lightning_tbp.memory.libraries import free_library_workspaces, warm_library_workspaces

    device = torch.device("cuda")
    warm_library_workspaces(device)
    held = torch.cuda.memory_allocated()
    free_library_workspaces(device)  # through compat.clear_cublas_workspaces
    assert torch.cuda.memory_allocated() < held
    warm_library_workspaces(device)  # made again: freeing them forgets that they were made
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == held


def test_model_parallel_strategy_keeps_its_mesh_sizes_where_compat_sets_them() -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy()
    assert hasattr(strategy, "_data_parallel_size") and hasattr(strategy, "_tensor_parallel_size")
    compat.make_data_parallel_only(strategy, 4)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (4, 1)


def test_module_states_are_broadcast_from_rank_0(tmp_path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layer = nn.Linear(2, 3)
        before = layer.weight.detach().clone()
        compat.broadcast_module_states(layer)
        assert torch.equal(layer.weight, before)  # one rank: its own weights
    finally:
        dist.destroy_process_group()


def test_a_modules_parameter_table_can_be_read_and_replaced() -> None:
    layer = nn.Linear(2, 3)
    table = compat.parameter_table(layer)
    assert set(table) == {"weight", "bias"}

    class Seen(dict):
        reads: list[str] = []

        def __getitem__(self, key: str) -> object:
            self.reads.append(key)
            return super().__getitem__(key)

    compat.set_parameter_table(layer, Seen(table))
    layer(torch.randn(1, 2))
    assert "weight" in Seen.reads  # the forward read its weight through the replaced table
    compat.set_parameter_table(layer, table)
    assert compat.parameter_table(layer) is table


def test_real_tensors_can_be_made_inside_a_fake_mode() -> None:
    """``compat.unset_fake_temporarily``: a library's first-use cache (torchao's code book) is
    built on real values while ``tbp estimate`` runs the step on fake tensors."""
    from lightning_tbp.compat import FakeTensor, FakeTensorMode, unset_fake_temporarily

    with FakeTensorMode():
        assert isinstance(torch.zeros(3), FakeTensor)
        with unset_fake_temporarily():
            real = torch.arange(3.0)
            assert not isinstance(real, FakeTensor) and real.tolist() == [0.0, 1.0, 2.0]


def test_a_storage_weak_reference_expires_with_the_storage_not_with_a_view() -> None:
    from lightning_tbp.compat import storage_key, storage_weak_ref

    base = torch.randn(1000)
    view = base[10:]
    reference = storage_weak_ref(view)
    key = storage_key(view)
    del base
    assert not reference.expired() and storage_key(view) == key  # the view keeps the storage
    del view
    assert reference.expired()


def test_fsdp2_gather_buffers_and_resharding_are_read_from_its_param_groups() -> None:
    """``fsdp2_gather_buffers``, ``fsdp2_reshards_after_forward`` and ``fsdp2_reduce_inputs_kept``
    read FSDP2's private param groups: in a process of its own (a gloo group of one), a unit's
    buffers exist after one gather, sized as its parameters, a block resharding after its forward
    says so, and one reduce-scatter input is kept unless the unit is told otherwise."""
    body = """
from torch.distributed.fsdp import fully_shard
from lightning_tbp import compat
model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
fully_shard(model[0])
fully_shard(model)
assert compat.fsdp2_gather_buffers(model[0]) == []
model(torch.randn(2, 8)).sum().backward()
buffers = compat.fsdp2_gather_buffers(model[0])
assert sum(t.numel() for t, _ in buffers) == 8 * 16 + 16 and all(trains for _, trains in buffers)
assert all(t.untyped_storage().size() == 0 for t, _ in buffers)  # resharded: storage resized away
assert compat.fsdp2_reshards_after_forward(model[0]) and not compat.fsdp2_reshards_after_forward(model)
assert compat.fsdp2_reduce_inputs_kept(model[0]) == 1
if hasattr(model[0], "set_reduce_scatter_max_input_buffers"):  # torch 2.13
    model[0].set_reduce_scatter_max_input_buffers(2)
    assert compat.fsdp2_reduce_inputs_kept(model[0]) == 2
"""
    run_in_a_gloo_group_of_one(body, port=29623)


def test_step_unobserved_runs_the_optimizers_own_step_without_torchs_hooks() -> None:
    """The planner's twins step through the function ``Optimizer.profile_hook_step`` wraps, so a
    global step hook never sees them; a class whose step is a mock cannot be stepped unseen."""
    from unittest import mock

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from lightning_tbp.compat import step_unobserved, unobserved_step

    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    optimizer = torch.optim.SGD([weight], lr=0.5)
    seen: list[object] = []
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: seen.append(opt))
    try:
        step_unobserved(optimizer)
        assert not seen
        torch.testing.assert_close(weight.detach(), torch.full((3,), 0.5))
        optimizer.step()
        assert seen == [optimizer]  # the hook is there: only the unobserved step passes it by
    finally:
        handle.remove()
    with mock.patch.object(torch.optim.SGD, "step") as mocked, pytest.raises(TypeError, match="not a function"):
        unobserved_step(torch.optim.SGD)
    assert not mocked.mock_calls  # not even an attribute of the mock was read
