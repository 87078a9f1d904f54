"""The package's shape: one op vocabulary, options that nest by one set of rules, no import cycles,
and a planner core (``remat``) that knows nothing of the step models built on it (DP)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from lightning_tbp.remat.ops import GradientHandOff, traits_of
from lightning_tbp.remat.options import Option, checkpoint_context, enclosing_block, next_options

aten = torch.ops.aten
PACKAGE = Path(__file__).resolve().parents[1] / "lightning_tbp"

COMPUTES, PASSES, ALIASES, SLICES = (
    GradientHandOff.COMPUTES,
    GradientHandOff.PASSES,
    GradientHandOff.ALIASES,
    GradientHandOff.SLICES,
)

# op: (view, picks_part, reshapes, writes_input, heavy, hand_off, contiguous_grad, saves_own_result, recomputable)
OP_TABLE = [
    (aten.mm.default, (False, False, False, False, True, COMPUTES, True, False, False)),
    (aten.convolution.default, (False, False, False, False, True, COMPUTES, True, False, False)),
    (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        (False, False, False, False, True, COMPUTES, True, True, False),
    ),
    (aten.native_group_norm.default, (False, False, False, False, False, COMPUTES, True, False, True)),
    (aten.native_layer_norm.default, (False, False, False, False, False, COMPUTES, True, False, True)),
    (aten.silu.default, (False, False, False, False, False, COMPUTES, False, False, True)),
    (aten.sigmoid.default, (False, False, False, False, False, COMPUTES, False, True, True)),
    (aten.add.Tensor, (False, False, False, False, False, ALIASES, False, False, True)),
    (aten.add.Scalar, (False, False, False, False, False, PASSES, False, False, True)),
    (aten.add_.Tensor, (False, False, False, True, False, COMPUTES, False, False, False)),
    (aten.sub.Tensor, (False, False, False, False, False, PASSES, False, False, True)),
    (aten.cat.default, (False, False, False, False, False, SLICES, False, False, False)),
    (aten.clone.default, (False, False, False, False, False, ALIASES, False, False, True)),
    (aten.detach.default, (True, False, False, False, False, ALIASES, False, False, True)),
    (aten.view.default, (True, False, True, False, False, COMPUTES, False, False, True)),
    (aten._unsafe_view.default, (False, False, True, False, False, COMPUTES, False, False, True)),
    (aten.transpose.int, (True, False, True, False, False, COMPUTES, False, False, True)),
    (aten.split.Tensor, (True, True, False, False, False, COMPUTES, False, False, True)),
    (aten.slice.Tensor, (True, True, False, False, False, COMPUTES, False, False, True)),
    (aten.select.int, (True, True, False, False, False, COMPUTES, False, False, True)),
    (aten.narrow_copy.default, (False, False, False, False, False, COMPUTES, False, False, False)),
    (aten.mul.Tensor, (False, False, False, False, False, COMPUTES, False, False, True)),
    (aten.exp.default, (False, False, False, False, False, COMPUTES, False, True, False)),
    (aten.copy_.default, (False, False, False, True, False, COMPUTES, False, False, False)),
]


@pytest.mark.parametrize(("op", "expected"), OP_TABLE, ids=[str(op) for op, _ in OP_TABLE])
def test_each_op_has_one_set_of_traits(op, expected) -> None:
    traits = traits_of(op)
    got = (
        traits.view,
        traits.picks_part,
        traits.reshapes,
        traits.writes_input,
        traits.heavy,
        traits.hand_off,
        traits.contiguous_grad,
        traits.saves_own_result,
        traits.recomputable,
    )
    assert got == expected
    assert traits.passes_grad == (traits.hand_off is not COMPUTES)


def test_traced_events_carry_the_traits_of_their_ops() -> None:
    from lightning_tbp.remat.record import record_trace

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU(), torch.nn.Linear(8, 8))
    trace = record_trace(model, (torch.randn(4, 8),), {}, measure=False)
    names = [t.name for t in trace.event_traits]
    assert "addmm.default" in names and "silu.default" in names
    assert all(t.heavy == t.name.startswith("addmm") for t in trace.event_traits)


def test_options_nest_by_one_set_of_rules() -> None:
    # a tree: 0 root, 1 stage, 2 and 3 blocks of the stage
    parents = [-1, 0, 1, 1]
    options = [Option.KEEP, Option.FULL, Option.KEEP, Option.FULL]
    assert checkpoint_context(parents, 3, 0, options) == 1  # the outermost checkpoint inside the region
    assert checkpoint_context(parents, 3, 1, options) == 3  # inside the stage's recompute
    assert checkpoint_context(parents, 2, 1, options) == -1
    assert enclosing_block(parents, 2, [Option.KEEP, Option.LAZY, Option.KEEP, Option.KEEP], Option.LAZY) == 1
    assert next_options(Option.KEEP, checkpointed_above=False, plain_below=True) == (
        Option.FULL,
        Option.SELECTIVE,
        Option.LAZY,
        Option.OFFLOAD,
        Option.STREAM,
    )
    assert next_options(Option.OFFLOAD, checkpointed_above=False, plain_below=True) == (Option.FULL, Option.STREAM)
    assert next_options(Option.STREAM, checkpointed_above=False, plain_below=True) == ()
    assert next_options(Option.FULL, checkpointed_above=True, plain_below=True) == ()  # a stream under a checkpoint
    assert next_options(Option.KEEP, checkpointed_above=True, plain_below=True) == (Option.FULL,)
    assert next_options(Option.FULL, checkpointed_above=False, plain_below=False) == ()


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at any depth of its code; imports under
    ``if TYPE_CHECKING:`` are for the type checker only and do not run)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(sub)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for sub in ast.walk(node)
        }
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_tbp"):
                submodules = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                deps.update(submodules if len(submodules) == len(node.names) else [node.module, *submodules])
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("lightning_tbp"))
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_has_no_import_cycle() -> None:
    assert _cycles(_import_graph()) == []


DP_WORDS = ("tap", "privacy", "clip", "book", "ghost", "per_sample", "noise")


def test_the_planner_core_knows_nothing_of_dp() -> None:
    graph = _import_graph()
    remat = [name for name in graph if name.startswith("lightning_tbp.remat")]
    assert remat
    for name in remat:
        assert not any(dep.startswith("lightning_tbp.privacy") for dep in graph[name]), name
    for path in (PACKAGE / "remat").rglob("*.py"):
        tree = ast.parse(path.read_text())
        identifiers = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        identifiers |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        identifiers |= {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        identifiers |= {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
        named = sorted(i for i in identifiers if i and any(word in i.lower() for word in DP_WORDS))
        assert not named, (path.name, named)
