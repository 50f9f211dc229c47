"""Rendering: deterministic, golden files, the template split, standalone modules, the kernel
cache (content-addressed, and robust to an unwritable or broken cache), config validation."""

import ast
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, ConfigError, KernelConfig, default_config
from flashgen.codegen import cache as C
from flashgen.codegen import render as R
from flashgen.codegen.plan import plan_for
from flashgen.runtime import host

from .helpers import child_pythonpath

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
HOPPER = KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, loop_order="q_outer", tma=True,
                      warp_specialize=True, bwd_tma=True)
# (file, spec, config): checked-in renders (as flashgen builds them: importing the host side),
# so template changes show up as diffs in review. Regenerate them (then review the diff) with
#     FLASHGEN_UPDATE_GOLDEN=1 python3 -m pytest -q tests/test_render.py -k golden
GOLDEN_CASES = [
    ("gqa_causal_q_outer.py",
     AttentionSpec(name="gqa-causal", dtype="bf16", head_dim=128, num_heads=32, num_kv_heads=8, causal=True), HOPPER),
    ("mha_full_kv_outer.py",
     AttentionSpec(name="mha", dtype="fp16", head_dim=64, num_heads=16),
     KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, loop_order="kv_outer")),
    ("hd80_causal_kv_outer.py",
     AttentionSpec(name="odd", dtype="fp32", head_dim=80, head_dim_v=48, num_heads=4, causal=True),
     KernelConfig(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1, loop_order="kv_outer")),
    # a built-in pattern with two segments, and a score modifier
    ("sink_softcap_q_outer.py",
     AttentionSpec(name="sink", dtype="bf16", head_dim=128, num_heads=16, mask={"sink": {"tokens": 4, "window": 1024}},
                   score_mod={"softcap": 30.0}, backward=True), HOPPER),
    # a custom expression (block map) over a tensor, and a score modifier with a gradient tensor
    ("custom_block_map_alibi_q_outer.py",
     AttentionSpec(name="custom", dtype="fp16", head_dim=64, num_heads=8,
                   mask="(q_idx >= kv_idx) & ((q_idx - kv_idx < 256) | (keep[b, kv_idx] != 0))",
                   score_mod={"alibi": {"slopes": "slopes"}}, backward=True),
     KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)),
    # a custom expression's block map in the KV-outer loop order
    ("custom_block_map_kv_outer.py",
     AttentionSpec(name="custom", dtype="fp16", head_dim=64, num_heads=8, mask="(q_idx - kv_idx) % 4 == 0"),
     KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, loop_order="kv_outer")),
    # a mask over a tensor (document ids) with dropout
    ("document_dropout_q_outer.py",
     AttentionSpec(name="document", dtype="fp16", head_dim=64, num_heads=4, mask={"document": {"ids": "doc"}},
                   dropout_p=0.1, backward=True),
     KernelConfig(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)),
]
GOLDEN_IDS = [c[0] for c in GOLDEN_CASES]
SPEC_CONSTANTS = ("HEAD_DIM", "HEAD_DIM_V", "BLOCK_D", "BLOCK_DV", "GQA_GROUP", "DOT_PRECISION", "RCP_LN2")
STANDALONE_IMPORTS = {"contextlib", "os", "sys", "threading", "zlib", "torch", "triton", "triton.language",
                      "triton.tools.tensor_descriptor", "triton.runtime"}  # interpret.py: the interpreter it patches


def _top_level_names(tree):
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Try):
            names |= _top_level_names(ast.Module(body=node.body + [h for x in node.handlers for h in x.body],
                                                 type_ignores=[]))
    return names


def _imports(tree):
    imports = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return imports | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}


@pytest.mark.parametrize("name,spec,config", GOLDEN_CASES, ids=GOLDEN_IDS)
def test_golden_files(name, spec, config):
    source = R.render(spec, config, standalone=False)
    path = GOLDEN / name
    if os.environ.get("FLASHGEN_UPDATE_GOLDEN"):
        path.write_text(source)
    assert source == path.read_text(), f"{name} changed: review the diff, then regenerate (see this file)"


def test_goldens_cover_a_mask_a_block_map_and_dropout():
    sources = {name: (GOLDEN / name).read_text() for name in GOLDEN_IDS}
    assert any("def _kv_segments(" in s and "Mask: " in s for s in sources.values())
    assert any("def _block_map_kernel(" in s for s in sources.values())
    assert any("def _keep(" in s for s in sources.values())


@pytest.mark.parametrize("name,spec,config", GOLDEN_CASES, ids=GOLDEN_IDS)
def test_the_plan_hands_templates_expressions_only(name, spec, config):
    # Statements and loops live in the templates: every text the plan gives them parses as one
    # Python expression (a statement or several lines would not).
    plan = plan_for(spec)
    texts = [plan.visible_code()]
    if plan.score_ir is not None:
        texts += [plan.score_code(), plan.score_grad_code()]
    texts += [t for add in plan.tensor_grad_adds() for t in (add.offset, add.derivative)]
    if not plan.block_map:
        for direction in ("kv", "q"):
            for seg in plan.segments(direction):
                texts += [seg.lo, seg.hi, seg.full_lo, seg.full_hi] + [code for _, code in seg.searches]
    for text in texts:
        ast.parse(text, mode="eval")


def test_segments_compute_each_search_once():
    # Two segments over one id tensor need the same two searches: the first segment brings
    # them, the second refers to them by name, and the rendered function searches twice.
    spec = AttentionSpec(head_dim=16, mask={"or": [{"document": {"ids": "doc"}},
                                                   {"document": {"ids": "doc", "causal": True}}]})
    segments = plan_for(spec).segments("kv")
    assert [[name for name, _ in seg.searches] for seg in segments] == [["s0", "s1"], []]
    assert (segments[1].lo, segments[1].full_lo) == ("s0", "s1")
    source = R.render(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16), standalone=False)
    body = source.split("def _kv_segments(")[1].split("\n\n")[0]
    assert body.count(" = tl.load(runs_doc + ") == 2 and "swap = lo1 < lo0" in body


@pytest.mark.parametrize("name,spec,config", GOLDEN_CASES, ids=GOLDEN_IDS)
def test_render_is_pure_and_valid_python(name, spec, config):
    for standalone in (True, False):
        a = R.render(spec, config, standalone=standalone)
        b = R.render(AttentionSpec.from_dict(spec.to_dict()), KernelConfig.from_dict(config.to_dict()),
                     standalone=standalone)
        assert a == b
        tree = ast.parse(a)
        # standalone: torch and triton only; else the host side comes from flashgen
        flashgen_host = {"flashgen.runtime.host", "flashgen.runtime.decode", "flashgen.runtime.hopper"}
        assert _imports(tree) <= STANDALONE_IMPORTS | (set() if standalone else flashgen_host)
        assert a.startswith(f"# Generated by flashgen {R.__version__} from template attention.py.j2 -- do not edit.")
        assert spec.uri in a.splitlines()[1]
        names = _top_level_names(tree)
        assert {"SPEC", "CONFIG", "forward", "backward", *SPEC_CONSTANTS} <= names
        assert "autotune" not in a  # the tuner owns the choice of config


def test_standalone_module_carries_the_host_source_verbatim():
    spec, config = GOLDEN_CASES[0][1:]
    standalone = R.render(spec, config)  # what `flashgen generate` writes
    imported = R.render(spec, config, standalone=False)
    assert host.__doc__ and R.host_source().rstrip("\n") in standalone
    assert not any(name.startswith("flashgen") for name in _imports(ast.parse(standalone)))
    assert R.decode_source().rstrip("\n") in standalone
    assert R.interpret_source().rstrip("\n") in standalone
    assert "from flashgen.runtime.host import AttentionLauncher" in imported
    # the two differ only in how the host side arrives: the banner-framed sources (host.py, then
    # decode.py less its import of host.py, then interpret.py and its patch_interpreter() under the
    # interpreter) or two imports
    framed = re.compile(r"# -+\n# The host side: flashgen/runtime/host.py .*?# -+ end of flashgen/runtime/interpret.py\n"
                        r"if interpreting\(\):.*?\n    patch_interpreter\(\)\n", re.S)
    assert len(framed.findall(standalone)) == 1
    import_lines = ("from flashgen.runtime.host import AttentionLauncher  # noqa: E402 (the host side: plain Python)\n"
                    "from flashgen.runtime.decode import DecodeLauncher  # noqa: E402\n")
    # and the imported module carries the Gluon FP8-cache decode (decode/fp8_cache.j2), which a standalone one leaves
    gluon_decode = re.compile(r"\n\nfrom flashgen.runtime.hopper import async_load.*?\n_DECODE.fp8_kernel = [^\n]*\n", re.S)
    assert len(gluon_decode.findall(imported)) == 1
    assert framed.sub(lambda m: import_lines, standalone) == gluon_decode.sub("", imported)


@pytest.mark.parametrize("source", [R.host_source, R.decode_source, R.interpret_source],
                         ids=["host", "decode", "interpret"])
def test_host_module_is_plain_python_that_needs_no_flashgen(source):
    tree = ast.parse(source())
    assert _imports(tree) <= STANDALONE_IMPORTS
    assert "{{" not in source() and "{%" not in source()
    assert "annotations" not in {a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}


@pytest.mark.parametrize("name,spec,config", GOLDEN_CASES, ids=GOLDEN_IDS)
def test_host_names_do_not_clash_with_the_kernels(name, spec, config):
    # A standalone module holds both in one namespace: the host must not rebind a kernel global.
    module_names = _top_level_names(ast.parse(R.render(spec, config, standalone=False)))
    host_names = set().union(*(_top_level_names(ast.parse(source())) for source in (R.host_source, R.decode_source,
                                                                                   R.interpret_source)))
    assert module_names & host_names <= {"torch", "triton", "tl", "AttentionLauncher", "DecodeLauncher"}, \
        module_names & host_names


@pytest.mark.parametrize("name,spec,config", GOLDEN_CASES, ids=GOLDEN_IDS)
def test_spec_constants_are_globals_not_parameters(name, spec, config):
    source = R.render(spec, config, standalone=False)
    tree = ast.parse(source)
    assert f"HEAD_DIM = tl.constexpr({spec.head_dim})" in source
    assert f"GQA_GROUP = tl.constexpr({spec.gqa_group})" in source
    assert source.count("1.4426950408889634") == 1  # log2(e) has one name, RCP_LN2
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.decorator_list:
            params = {a.arg for a in node.args.args}
            assert not params & set(SPEC_CONSTANTS), (node.name, params & set(SPEC_CONSTANTS))


def test_spec_constants_are_computed_once():
    spec = AttentionSpec(dtype="fp32", head_dim=80, head_dim_v=48, num_heads=6, num_kv_heads=2)
    assert R.spec_constants(spec) == dict(head_dim=80, head_dim_v=48, block_d=128, block_dv=64, gqa_group=3,
                                          dot_precision="ieee")
    assert R.spec_constants(spec.replace(dtype="fp16", head_dim=8))["block_d"] == 16
    assert R.spec_constants(spec.replace(dtype="bf16"))["dot_precision"] == "tf32"


def test_structure_follows_the_spec():
    spec = AttentionSpec(head_dim=64)
    render = functools.partial(R.render, standalone=False)  # the kernels, without the host's docstrings
    full = render(spec, KernelConfig())
    causal = render(spec.replace(causal=True), KernelConfig())
    kv = render(spec, KernelConfig(loop_order="kv_outer"))
    # the causal bound appears in the predicate and the segment ranges only when asked for
    assert "cols <= (rows + (seqlen_k - seqlen_q))" not in full
    assert "cols <= (rows + (seqlen_k - seqlen_q))" in causal and "(r0 + (seqlen_k - seqlen_q)) + 1" in causal
    assert "_block_map_kernel" not in causal
    custom = render(spec.replace(mask="(q_idx - kv_idx) % 4 == 0"), KernelConfig())
    assert "def _block_map_kernel(" in custom and "_kv_segments" not in custom
    assert "def _attn_fwd(" in full and "_attn_fwd_kv_outer" not in full
    assert "def _attn_fwd_kv_outer(" in kv and "def _attn_fwd(" not in kv
    assert "def _keep(" not in full and "def _keep(" in render(spec.replace(dropout_p=0.1), KernelConfig())
    # the score floor (common/tiles.j2's _finalize) only where the modifier reads a value per key from a tensor
    floored = [name for name, mod in (("bias", "score + bias[q_idx, kv_idx]"), ("softcap", {"softcap": 30.0}),
                                      ("slopes", {"alibi": {"slopes": "slopes"}}), ("per-key", "score * w[kv_idx]"))
               if "-65536.0" in render(spec.replace(score_mod=mod), KernelConfig())]
    assert floored == ["bias", "per-key"]


def _templates():
    root = R.template_dir()
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*.j2"))}


def test_templates_are_split_by_kernel_family():
    templates = _templates()
    assert {"attention.py.j2", "prefill/q_outer.j2", "prefill/kv_outer.j2", "backward/preprocess.j2",
            "backward/dkdv.j2", "backward/dq.j2", "decode/split_kv.j2", "decode/combine.j2",
            "common/walk_blocks.j2"} <= set(templates)
    for name, text in templates.items():
        assert len(text.splitlines()) <= 400, f"{name}: {len(text.splitlines())} lines"
    # the entry template only sets and includes
    for line in templates["attention.py.j2"].splitlines():
        assert line.startswith(("{%- set", "{% include", "{% if", "{% endif", "{#", "    ")) or not line.strip(), line
    # the block-map / segment dispatch is written once (a macro) and used by the six kernels
    everything = "".join(templates.values())
    assert everything.count("_map_row(") == 2 and everything.count("= _span(") == 1  # its definition and one use
    calls = {name for name, text in templates.items() if "walk_blocks(" in text and not name.startswith("common/")}
    assert calls == {"prefill/q_outer.j2", "prefill/kv_outer.j2", "backward/dkdv.j2", "backward/dq.j2",
                     "backward/short.j2", "decode/split_kv.j2"}


def test_templates_hash_covers_every_partial_of_the_tuned_families(tmp_path, monkeypatch):
    assert len(R.templates_hash()) == 16
    before = R.templates_hash()
    copy = tmp_path / "templates"
    shutil.copytree(R.template_dir(), copy)
    monkeypatch.setattr(R, "template_dir", lambda: copy)
    assert R.templates_hash() == before
    for name in ("common/math.j2", "prefill/q_outer.j2", "backward/dq.j2", "host/launcher.j2"):
        partial = copy / name
        partial.write_text(partial.read_text() + "\n")
        assert R.templates_hash() != before, name
        partial.write_text(partial.read_text()[:-1])
        assert R.templates_hash() == before
    # decode is not tuned yet: its kernels and the host code do not stale tuned prefill/backward results
    decode = copy / "decode" / "split_kv.j2"
    decode.write_text(decode.read_text() + "\n")
    monkeypatch.setattr(R, "host_source", lambda: host.__doc__)
    assert R.templates_hash() == before


@pytest.fixture
def edited_templates(tmp_path, monkeypatch):
    """A copy of the templates that flashgen renders from, for a test to edit (the caches of
    the old ones cleared, and cleared again afterwards); edit(name, old, new) edits one."""
    copy = tmp_path / "templates"
    shutil.copytree(R.template_dir(), copy)
    monkeypatch.setattr(R, "template_dir", lambda: copy)

    def edit(name, old, new):
        text = (copy / name).read_text()
        assert old in text, (name, old)
        (copy / name).write_text(text.replace(old, new, 1))
        R._environment.cache_clear()
        R.kernel_hash.cache_clear()

    R._environment.cache_clear()
    R.kernel_hash.cache_clear()
    yield edit
    R._environment.cache_clear()
    R.kernel_hash.cache_clear()


KERNEL_SPEC = AttentionSpec(name="timed", dtype="fp16", head_dim=64, num_heads=4, causal=True, backward=True)
KERNEL_CONFIG = KernelConfig(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)


def test_timed_source_is_what_each_phase_runs():
    source = R.render(KERNEL_SPEC, KERNEL_CONFIG, standalone=False)
    fwd, bwd = R.timed_source(source, "fwd"), R.timed_source(source, "bwd")
    assert "def _attn_fwd(" in fwd and "def _online_softmax_step(" in fwd and "HEAD_DIM = tl.constexpr(64)" in fwd
    assert "def _attn_bwd_dkdv(" in bwd and "def _attn_bwd_dq(" in bwd and "def _bwd_preprocess(" in bwd
    assert "def _attn_bwd_dq(" not in fwd and "def _attn_fwd(" not in bwd
    for text in (fwd, bwd):  # not the decode kernels, the header, SPEC, CONFIG or any comment
        assert "_attn_decode" not in text and "_decode_combine" not in text and "#" not in text
        assert "SPEC = " not in text and "CONFIG = " not in text and "BLOCK_MAP = " not in text
    with pytest.raises(ValueError, match="phase: expected one of fwd, bwd, got 'decode'"):
        R.timed_source(source, "decode")


def test_timed_source_holds_the_gluon_kernels_handed_to_the_launcher():
    """The Hopper family's Gluon kernels are attached to the launcher after it is made
    (_LAUNCHER.hopper_forward / hopper_backward): a stored result of a hopper_ws or hopper_bwd
    config was timed on them, so their text is part of its phase's hash (an edit of the Gluon
    forward leaves a result measured on the old one unserved)."""
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=4, causal=True, backward=True)
    config = KernelConfig(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, hopper_bwd=True)
    source = R.render(spec, config, standalone=False)
    fwd, bwd = R.timed_source(source, "fwd"), R.timed_source(source, "bwd")
    assert "def _attn_fwd_hopper_ws(" in fwd and "def _hw_consumer(" in fwd and "def _attn_bwd_dkdv_hopper(" not in fwd
    assert "def _attn_bwd_dkdv_hopper(" in bwd and "def _hb_consumer(" in bwd and "def _attn_fwd_hopper_ws(" not in bwd
    portable = R.timed_source(R.render(spec, KernelConfig(BLOCK_M=64, BLOCK_N=64), standalone=False), "fwd")
    assert "hopper" not in portable
    edited = source.replace("def _hw_softmax(", "def _hw_softmax_edited(").replace("_hw_softmax(qk", "_hw_softmax_edited(qk")
    assert R.timed_source(edited, "fwd") != fwd and R.timed_source(edited, "bwd") == bwd
    # documents: each Gluon kernel's block-range kernel (HopperForward(..., ranges=...)) is its phase's too
    docs = spec.replace(causal=False, mask={"document": {"ids": "doc"}})
    source = R.render(docs, config, standalone=False)
    fwd, bwd = R.timed_source(source, "fwd"), R.timed_source(source, "bwd")
    assert "def _hw_fwd_ranges(" in fwd and "def _hw_bwd_ranges(" not in fwd
    assert "def _hw_bwd_ranges(" in bwd and "def _hw_fwd_ranges(" not in bwd


def test_kernel_hash_follows_the_kernels_not_the_names_or_tiles():
    fwd = R.kernel_hash(KERNEL_SPEC, KERNEL_CONFIG, "fwd")
    assert len(fwd) == 16 and fwd != R.kernel_hash(KERNEL_SPEC, KERNEL_CONFIG, "bwd")
    # the spec's name and tune section, and the tile sizes (kernel parameters), are not kernel text
    renamed = KERNEL_SPEC.replace(name="other", tune={"trials": 3})
    assert R.kernel_hash(renamed, KERNEL_CONFIG.replace(BLOCK_M=128, num_warps=8), "fwd") == fwd
    # the loop order picks another forward kernel; another head dim is another constant
    assert R.kernel_hash(KERNEL_SPEC, KERNEL_CONFIG.replace(loop_order="kv_outer"), "fwd") != fwd
    assert R.kernel_hash(KERNEL_SPEC.replace(head_dim=32), KERNEL_CONFIG, "fwd") != fwd


def test_kernel_hash_changes_only_with_the_timed_kernels(edited_templates):
    def hashes():
        return R.kernel_hash(KERNEL_SPEC, KERNEL_CONFIG, "fwd"), R.kernel_hash(KERNEL_SPEC, KERNEL_CONFIG, "bwd")

    fwd, bwd = before = hashes()
    templates = R.templates_hash()
    # edits that leave the kernels' code alone: a comment inside a kernel, a blank line, the
    # decode family, a helper no kernel calls, the header
    edited_templates("common/tiles.j2", "# K^T as (BLOCK_D, BLOCK_N) and V as (BLOCK_N, BLOCK_DV); padding reads as 0.",
                     "# the K^T and V tiles\n")
    edited_templates("decode/split_kv.j2", "@triton.jit", "# decode\n@triton.jit")
    edited_templates("common/math.j2", "@triton.jit", "@triton.jit\ndef _unused(x):\n    return x + 1\n\n\n@triton.jit")
    edited_templates("common/header.j2", "-- do not edit.", "-- do not edit (really).")
    assert R.templates_hash() != templates and hashes() == before
    # code only the backward runs: the backward's hash only
    edited_templates("backward/preprocess.j2", "tl.sum(o * do, 1)", "tl.sum(do * o, 1)")
    after = hashes()
    assert after[0] == fwd and after[1] != bwd
    # code both run
    edited_templates("common/tiles.j2", "    return k, v\n", "    k, v = k, v\n    return k, v\n")
    assert hashes()[0] != fwd


def test_build_module_replaces_render_load():
    assert not hasattr(R, "load")
    module = R.build_module(AttentionSpec(name="built", head_dim=16), KernelConfig(BLOCK_M=16, BLOCK_N=16))
    assert module.forward.__self__ is module._LAUNCHER and module.CONFIG["BLOCK_M"] == 16


def test_cache_is_content_addressed_and_repairs_broken_files(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    spec, config = AttentionSpec(name="cache", head_dim=32), KernelConfig(BLOCK_M=16, BLOCK_N=16)
    source = R.render(spec, config, standalone=False)
    path = C.cached_source_path(spec.uri, source)
    assert path.parent.is_relative_to(tmp_path) and path.read_text() == source
    assert path.name.startswith(spec.uri)
    mtime = path.stat().st_mtime_ns
    assert C.cached_source_path(spec.uri, source) == path and path.stat().st_mtime_ns == mtime  # unchanged: no write
    path.write_bytes(b"\xff\xfe garbage")  # a broken artifact is rewritten, never raised
    assert C.cached_source_path(spec.uri, source) == path and path.read_text() == source
    assert not list(path.parent.glob(".*.tmp"))


@pytest.fixture
def fresh_cache_state(monkeypatch):
    """Forget the temporary stand-in and the warnings given, so each test sees its own."""
    monkeypatch.setattr(C, "_fallback", None)
    monkeypatch.setattr(C, "_warned", set())


def test_cache_entry_that_is_a_directory_is_built_elsewhere(tmp_path, monkeypatch, fresh_cache_state):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    spec, config = AttentionSpec(name="dir-entry", head_dim=16), KernelConfig(BLOCK_M=16, BLOCK_N=16)
    source = R.render(spec, config, standalone=False)
    entry = C.cache_dir() / f"{spec.uri}-{hashlib.sha256(source.encode()).hexdigest()[:16]}.py"
    (entry / "squatter").mkdir(parents=True)
    with pytest.warns(C.KernelCacheWarning, match="is a directory") as record:
        module = R.build_module(spec, config)
    assert str(entry) in str(record[0].message)
    assert Path(module.__file__).read_text() == source and not Path(module.__file__).is_relative_to(tmp_path)
    assert entry.is_dir()  # left alone


def test_unwritable_cache_dir_warns_once_and_falls_back(tmp_path, monkeypatch, fresh_cache_state):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(blocker / "cache"))  # cannot be created, even by root
    config = KernelConfig(BLOCK_M=16, BLOCK_N=16)
    with pytest.warns(C.KernelCacheWarning) as record:
        first = R.build_module(AttentionSpec(name="ro-a", head_dim=16), config)
        second = R.build_module(AttentionSpec(name="ro-b", head_dim=16), config)
    assert len(record) == 1  # once
    message = str(record[0].message)
    assert f"FLASHGEN_CACHE_DIR={blocker / 'cache'}" in message and str(C._fallback) in message
    assert Path(first.__file__).parent == Path(second.__file__).parent == C._fallback
    assert oct(C._fallback.stat().st_mode & 0o777) == "0o700"  # private


def test_standalone_module_runs_without_flashgen(tmp_path, device):
    # What `flashgen generate` writes, in a fresh interpreter where importing flashgen fails,
    # checked against torch's own attention (fp32: the interpreter has no bf16 dot).
    spec = AttentionSpec(name="standalone", dtype="fp32", head_dim=24, num_heads=4, num_kv_heads=2, causal=True,
                         backward=True)
    config = KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1, BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16,
                          bwd_num_stages=1)
    path = tmp_path / "my_attention.py"
    path.write_text(R.render(spec, config, standalone=True))
    script = textwrap.dedent(f"""
        import importlib.util, sys
        sys.modules["flashgen"] = None  # `import flashgen` raises from here on
        import torch
        import torch.nn.functional as F
        spec = importlib.util.spec_from_file_location("my_attention", {str(path)!r})
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        assert not any(name.startswith("flashgen") for name in sys.modules if sys.modules[name] is not None)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, h, 19, 24, generator=gen).to({device!r}).requires_grad_() for h in (4, 2, 2))
        out, lse = mod.forward(q, k, v)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 1e-5, err
        do = torch.randn(out.shape, generator=gen).to({device!r})
        dq, dk, dv, _ = mod.backward(do, q, k, v, out, lse)
        for got, want in zip((dq, dk, dv), torch.autograd.grad(ref, (q, k, v), do)):
            assert ((got - want).norm() / want.norm()).item() < 1e-4
        print("standalone ok", err)
    """)
    # Compiled on this process's GPU where it has one, else through the interpreter.
    env = dict(os.environ, TRITON_INTERPRET="1" if device == "cpu" else "0", PYTHONPATH=child_pythonpath())
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "standalone ok" in proc.stdout


EXAMPLES = sorted((ROOT / "examples" / "specs").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_spec_renders_and_imports(path):
    spec = AttentionSpec.from_yaml(path)
    # FP8 specs are inference-only: the Q-outer forward, no dropout
    for loop_order in ("q_outer",) if spec.fp8 else ("q_outer", "kv_outer"):
        for dropout_p in (0.0,) if spec.fp8 else (0.0, 0.1):
            variant = spec.replace(dropout_p=dropout_p)
            module = R.build_module(variant, default_config(variant, "cpu").replace(loop_order=loop_order))
            assert module.SPEC["dropout_p"] == dropout_p and hasattr(module, "dropout_keep_mask") == (dropout_p > 0)
            assert module.TENSORS == list(spec.tensor_names)


@pytest.mark.parametrize("name,loop_order", [("sliding-window", "q_outer"), ("window-and-chunk", "kv_outer"),
                                             ("custom-mask", "q_outer")])
def test_example_specs_still_match_the_reference(name, loop_order, device):
    # The example's mask and modifier at a size the interpreter runs (fp16: no bf16 dot there).
    from flashgen.verify import assert_attention_close

    spec = AttentionSpec.from_yaml(ROOT / "examples" / "specs" / f"{name}.yaml")
    spec = spec.replace(dtype="fp16", head_dim=32, head_dim_v=32, num_heads=2, num_kv_heads=1)
    config = KernelConfig(BLOCK_M=32, BLOCK_N=32, num_stages=1, loop_order=loop_order)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, 150, 32, generator=gen).to(device, torch.float16) for h in (2, 1, 1))
    out, lse = flashgen.compile(spec, config).forward(q, k, v)
    assert_attention_close(out, lse, q, k, v, causal=spec.causal, mask=spec.mask, score_mod=spec.score_mod)


@pytest.mark.parametrize("knob,value", [("BLOCK_M", 48), ("BLOCK_N", 512), ("num_warps", 3), ("num_stages", 0),
                                        ("loop_order", "diagonal"), ("BLOCK_M", True)])
def test_bad_config_knob_names_knob_and_value(knob, value):
    with pytest.raises(ConfigError) as info:
        KernelConfig(**{knob: value})
    assert f"'{knob}'" in str(info.value) and repr(value) in str(info.value)


def test_default_config_per_gpu_family():
    spec = AttentionSpec(dtype="bf16", head_dim=128)
    assert default_config(spec, "h100").BLOCK_N == 128
    assert default_config(spec.replace(head_dim=256), "h100").BLOCK_M == 64
    assert default_config(spec, "cpu").num_stages == 1
    assert default_config(spec.replace(dtype="fp32"), "a100").BLOCK_N == 32
    with pytest.raises(ConfigError, match="unknown"):
        KernelConfig.from_dict({"BLOCK_K": 16})


class _IntCode(int):
    """An int whose repr is code that leaves a file behind when it runs."""

    mark = "flashgen-pwned"

    def __repr__(self):
        return f"(__import__('pathlib').Path({self.mark!r}).touch() or {int.__repr__(self)})"

    __str__ = __repr__


def _import_in_child(path: Path, cwd: Path) -> None:
    code = f"import importlib.util as u; s = u.spec_from_file_location('m', {str(path)!r}); " \
           "s.loader.exec_module(u.module_from_spec(s))"
    subprocess.run([sys.executable, "-c", code], cwd=cwd, check=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": child_pythonpath(ROOT)})
    assert not (cwd / _IntCode.mark).exists(), "importing the generated module ran code from a spec value"


def test_numbers_reach_the_generated_module_as_literals_never_through_their_repr(tmp_path):
    spec = AttentionSpec(head_dim=_IntCode(16), num_heads=_IntCode(2), num_kv_heads=_IntCode(1))
    config = default_config(spec, target="cpu")
    source = R.render(spec, config)
    assert "__import__" not in source and "'head_dim': 16," in source
    (tmp_path / "m.py").write_text(source)
    _import_in_child(tmp_path / "m.py", tmp_path)
    # the literal writer itself: numbers from their base type, other objects refused
    assert R._literal({"a": _IntCode(3), "b": [(1,), (2, 3)], "c": None}) == "{\n    'a': 3,\n    'b': [(1,), (2, 3)],\n    'c': None,\n}"
    with pytest.raises(TypeError, match="object"):
        R._literal({"a": object()})


def test_the_cli_generated_file_holds_no_code_from_spec_values(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from flashgen import cli

    # YAML cannot make an int subclass; a spec built in Python (as a plugin or wrapper would) can
    monkeypatch.setattr(cli.AttentionSpec, "from_yaml",
                        classmethod(lambda cls, path: cls(head_dim=_IntCode(16), num_heads=_IntCode(2))))
    (tmp_path / "s.yaml").write_text("head_dim: 16\n")
    out = tmp_path / "k.py"
    result = CliRunner().invoke(cli.main, ["generate", "--spec", str(tmp_path / "s.yaml"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "__import__" not in out.read_text() and "pwned" not in result.output
    _import_in_child(out, tmp_path)


def test_written_files_get_a_plain_writes_mode(tmp_path):
    # mkstemp's 0600 made `flashgen generate -o` and `export` files private (and overwriting reset the mode)
    import os
    import stat

    from flashgen.codegen.cache import write_atomic

    old = os.umask(0o022)
    try:
        path = tmp_path / "out.py"
        write_atomic(path, "x = 1\n")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        path.chmod(0o640)
        write_atomic(path, "x = 2\n")
        assert stat.S_IMODE(path.stat().st_mode) == 0o640 and path.read_text() == "x = 2\n"
    finally:
        os.umask(old)
