"""Each built-in pattern file's contract, without running a kernel: its key interval holds
exactly the keys its predicate makes visible (per query row, and the rows per key column),
its checks name the field, and the package keeps one-way imports (expr <- masks <- codegen)."""

import ast
from pathlib import Path

import pytest
import torch

from flashgen import AttentionSpec
from flashgen.codegen.plan import KernelPlan, plan_for
from flashgen.expr.to_torch import evaluate
from flashgen.masks.registry import PATTERNS

PACKAGE = Path(__file__).resolve().parent.parent / "flashgen"

# (pattern, params): edges included (window 0, prefix 0 and past the end, a sink of 0 tokens)
CASES = [
    ("causal", {"align": "bottom_right"}), ("causal", {"align": "top_left"}),
    ("sliding_window", {"left": 0, "right": 0, "align": "bottom_right"}),
    ("sliding_window", {"left": 3, "right": -1, "align": "top_left"}),
    ("sliding_window", {"left": -1, "right": 2, "align": "bottom_right"}),
    ("sliding_window", {"left": 5, "right": 1, "align": "bottom_right"}),
    ("chunked", {"size": 1, "causal": True, "align": "bottom_right"}),
    ("chunked", {"size": 6, "causal": False, "align": "top_left"}),
    ("chunked", {"size": 7, "causal": True, "align": "bottom_right"}),
    ("prefix_lm", {"prefix": 0, "align": "bottom_right"}), ("prefix_lm", {"prefix": 40, "align": "top_left"}),
    ("prefix_lm", {"prefix": 4, "align": "bottom_right"}),
    ("sink", {"tokens": 0, "window": 3, "align": "bottom_right"}),
    ("sink", {"tokens": 3, "window": 4, "align": "top_left"}),
]


def _in_segments(intervals, low, high, var, values, limit, sizes):
    """[len(values), limit] bool: index j lies in one of the intervals' [low, high) at var = value."""
    j = torch.arange(limit)[None, :]
    inside = torch.zeros(len(values), limit, dtype=torch.bool)
    for iv in intervals:
        env = {var: values[:, None], **sizes}
        lo = torch.as_tensor(evaluate(getattr(iv, low), env, {})).broadcast_to(len(values), 1)
        hi = torch.as_tensor(evaluate(getattr(iv, high), env, {})).broadcast_to(len(values), 1)
        inside |= (lo <= j) & (j < hi)
    return inside


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(13, 29), (29, 13), (20, 20)])
@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_interval_holds_exactly_the_visible_keys(name, params, seqlen_q, seqlen_k):
    pattern = PATTERNS[name]
    sizes = {"seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    rows, cols = torch.arange(seqlen_q), torch.arange(seqlen_k)
    env = {"b": 0, "h": 0, "q_idx": rows[:, None], "kv_idx": cols[None, :], **sizes}
    visible = torch.as_tensor(evaluate(pattern.predicate(params), env, {})).broadcast_to(seqlen_q, seqlen_k)
    intervals = pattern.intervals(params)
    keys = _in_segments(intervals, "lo", "hi", "r", rows, seqlen_k, sizes)
    assert torch.equal(keys, visible), "keys of each row"
    queries = _in_segments(intervals, "qlo", "qhi", "c", cols, seqlen_q, sizes)
    assert torch.equal(queries, visible.T), "rows of each key"


def test_every_pattern_file_declares_its_parts():
    for name, pattern in PATTERNS.items():
        assert pattern.name == name
        assert callable(pattern.check) and callable(pattern.predicate) and callable(pattern.intervals)
        assert pattern.shorthand is None or pattern.shorthand in pattern.params


def test_the_plan_is_built_from_the_spec_not_stored_on_it():
    spec = AttentionSpec(head_dim=16, mask={"document": {}}, score_mod={"alibi": {}})
    assert not hasattr(spec, "plan") and "plan" not in vars(spec)
    plan = plan_for(spec)
    assert isinstance(plan, KernelPlan) and plan is plan_for(spec.replace(name="other"))  # cached per mask
    assert [t.name for t in plan.tensors] == ["alibi_slopes", "document_ids"] and plan.same_seqlen
    assert plan.tensor_params.startswith(", t_alibi_slopes, t_alibi_slopes_s0, t_alibi_slopes_s1, ")
    assert plan.grad_params == ", g_alibi_slopes"


def _imports(path: Path) -> set[str]:
    """The flashgen modules a file imports, as dotted names relative to the package."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[:len(package) - node.level + 1])
            target = ".".join(base + ([node.module] if node.module else []))
            names = [f"{target}.{a.name}" for a in node.names]
            out.update(n for n in names if (PACKAGE.parent / (n.replace(".", "/") + ".py")).exists()
                       or (PACKAGE.parent / n.replace(".", "/")).is_dir())
            if node.module:
                out.add(target)
    return {m for m in out if m.startswith("flashgen")}


def test_imports_flow_one_way_without_loops():
    files = [p for d in ("expr", "masks", "codegen") for p in sorted((PACKAGE / d).glob("*.py"))]
    graph = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): _imports(p)
             for p in files}
    allowed = {"expr": ("flashgen.expr", "flashgen.errors"), "masks": ("flashgen.expr", "flashgen.masks",
                                                                      "flashgen.errors")}
    after_codegen = ("flashgen.api", "flashgen.ops", "flashgen.loader", "flashgen.verify", "flashgen.tuner",
                     "flashgen.bench", "flashgen.cli", "flashgen.db")
    for module, deps in graph.items():
        layer = module.split(".")[1]
        if layer in allowed:
            assert all(d.startswith(allowed[layer]) for d in deps), (module, sorted(deps))
        else:  # codegen: anything before it in the flow, nothing after
            assert not any(d.startswith(after_codegen) for d in deps), (module, sorted(deps))
    # no cycle among the modules (a package's __init__ may import its own modules)
    state = {}

    def visit(m, trail):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", " -> ".join(trail + [m])
        state[m] = "open"
        for d in graph.get(m, ()):
            if d != m and not m.endswith(("masks", "expr", "codegen")):
                visit(d, trail + [m])
        state[m] = "done"

    for m in graph:
        visit(m, [])


def test_no_file_over_400_lines():
    for d in ("expr", "masks", "codegen"):
        for p in (PACKAGE / d).glob("*.py"):
            assert len(p.read_text().splitlines()) <= 400, p
