"""AttentionSpec: loading, defaults, identity, and one clear error per bad field."""

import textwrap
import time
from pathlib import Path

import pytest

import flashgen
from flashgen import AttentionSpec, SpecError, TuneSpec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "specs"

ISSUE_EXAMPLE = """\
name: gqa-causal
dtype: bf16
head_dim: 128
num_heads: 32
num_kv_heads: 8
causal: true
backward: true
target: h100
tune:
  seqlens: [1024, 4096, 16384]
  trials: 64
"""


def test_issue_example_loads_unchanged(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(ISSUE_EXAMPLE)
    spec = AttentionSpec.from_yaml(path)
    assert (spec.name, spec.dtype, spec.head_dim, spec.head_dim_v) == ("gqa-causal", "bf16", 128, 128)
    assert (spec.num_heads, spec.num_kv_heads, spec.gqa_group) == (32, 8, 4)
    assert spec.causal and spec.backward and spec.target == "h100"
    assert spec.tune == TuneSpec(seqlens=(1024, 4096, 16384), trials=64)
    assert spec.scale == pytest.approx(128 ** -0.5)
    assert spec.uri == "gqa-causal_bf16_hd128_h32kv8_causal_train"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_specs_load(path):
    assert AttentionSpec.from_yaml(path).name


def test_defaults_and_python_construction():
    spec = AttentionSpec(head_dim=80, num_heads=6)
    assert spec.head_dim_v == 80 and spec.num_kv_heads == 6 and spec.dropout_p == 0.0
    assert spec.target == "auto" and not spec.causal and spec.softmax_scale is None
    assert AttentionSpec(dtype="float16").dtype == "fp16"  # torch-style alias


def test_specs_equal_but_for_a_parameters_type_are_two_kernels():
    # Python holds 16777217 == 16777217.0, yet kv_idx * w is exact in integers and rounds in float32: the two specs
    # compared (and hashed) equal and shared one cached kernel, whose outputs were then 1.2 off for the second
    # (a review's catch). A softcap's cap is a float however written: one kernel and one key for tuned results.
    exact, rounded = (AttentionSpec(score_mod={"expr": "where((kv_idx * w) % 2 == 1, score, score - 5.0)",
                                               "params": {"w": w}}) for w in (16777217, 16777217.0))
    assert exact != rounded and exact.key != rounded.key and hash(exact.score_mod) != hash(rounded.score_mod)
    masks = [AttentionSpec(mask={"expr": "(kv_idx * w) % 2 == 1", "params": {"w": w}}) for w in (3, 3.0)]
    assert len({m.mask_node for m in masks}) == 2 and len({m.key for m in masks}) == 2
    assert AttentionSpec(score_mod={"softcap": 30}) == AttentionSpec(score_mod={"softcap": 30.0})
    assert AttentionSpec(score_mod={"softcap": 30}).key == AttentionSpec(score_mod={"softcap": 30.0}).key


def test_key_is_the_computation_uri_is_readable():
    a = AttentionSpec(name="a", head_dim=64, num_heads=8, causal=True)
    b = AttentionSpec(name="b", head_dim=64, num_heads=8, causal=True, tune={"trials": 3}, target="h100")
    c = AttentionSpec(name="a", head_dim=64, num_heads=8, causal=False)
    assert a.key == b.key  # name, target and tuning budget do not change the kernel
    assert a.key != c.key
    # an explicit scale equal to the default is the same computation
    assert AttentionSpec(head_dim=64).key == AttentionSpec(head_dim=64, softmax_scale=0.125).key
    assert a.uri == "a_fp16_hd64_h8kv8_causal_fwd"
    assert AttentionSpec.from_dict(a.to_dict()) == a


def test_flash_attn_causal_as_a_mask_is_the_causal_spec():
    """`mask: {causal: {}}` (bottom-right, the default align), alone or and-ed in at the top, is stored as
    `causal: true`: one key, one kernel, the unmasked causal path's defaults. Top-left causal and causal
    inside an or stay masks."""
    plain = AttentionSpec(name="a", head_dim=64, num_heads=8, causal=True)
    for mask in ({"causal": {}}, {"causal": {"align": "bottom_right"}}, {"and": [{"causal": {}}, {"causal": {}}]},
                 flashgen.mask(causal={})):
        spec = AttentionSpec(name="a", head_dim=64, num_heads=8, mask=mask)
        assert spec == plain and spec.key == plain.key and spec.uri == plain.uri
        assert spec.causal is True and spec.mask is None
        assert AttentionSpec(name="a", head_dim=64, num_heads=8, causal=True, mask=mask) == plain
    window = {"sliding_window": {"left": 8, "right": 0}}
    both = AttentionSpec(head_dim=64, causal=True, mask=window)
    for mask in ({"and": [window, {"causal": {}}]}, {"and": [{"causal": {}}, window]},
                 flashgen.mask(**window) & flashgen.mask(causal={})):
        spec = AttentionSpec(head_dim=64, mask=mask)
        assert spec == both and spec.key == both.key and spec.mask.kind == "sliding_window"
    three = AttentionSpec(head_dim=64, mask={"and": [window, {"causal": {}}, {"prefix_lm": 4}]})
    assert three.causal and [c.kind for c in three.mask.children] == ["sliding_window", "prefix_lm"]
    for kept in ({"causal": {"align": "top_left"}}, {"or": [{"causal": {}}, window]}):
        spec = AttentionSpec(head_dim=64, mask=kept)
        assert not spec.causal and spec.mask is not None and spec.key != plain.key
    assert AttentionSpec.from_dict(three.to_dict()) == three
    # chained &: and-s nested in and-s are one conjunction
    prefix = {"prefix_lm": 4}
    chained = AttentionSpec(head_dim=64, mask=flashgen.mask(causal={}) & flashgen.mask(**window) & flashgen.mask(**prefix))
    assert chained == AttentionSpec(head_dim=64, causal=True, mask={"and": [window, prefix]})
    # causal taken out where it stands: the rest keeps the nesting the `causal: true` spelling writes
    expr = "kv_idx >= q_idx - 100"
    assert AttentionSpec(head_dim=64, mask={"and": [{"causal": {}}, {"and": [window, expr]}, prefix]}).key == \
        AttentionSpec(head_dim=64, causal=True, mask={"and": [{"and": [window, expr]}, prefix]}).key
    w, e, p = flashgen.mask(**window), flashgen.mask(expr), flashgen.mask(**prefix)
    assert AttentionSpec(head_dim=64, mask=flashgen.mask(causal={}) & w & e & p) == \
        AttentionSpec(head_dim=64, causal=True, mask=w & e & p)
    nested = {"and": [window, prefix]}  # (without causal a mask is kept as written: its key unchanged)
    assert AttentionSpec(head_dim=64, mask={"and": [nested]}).mask == AttentionSpec(head_dim=64, mask=nested).mask
    # replace(mask=...) replaces the whole old mask, the causal bound it became included (a review's catch: a
    # two-sided window replacing `mask: {causal: {}}` was silently made causal)
    masked = AttentionSpec(head_dim=64, mask={"causal": {}})
    assert not masked.replace(mask={"sliding_window": {"left": 8, "right": 8}}).causal
    assert not masked.replace(mask=None).causal and not masked.replace(dtype="fp32").replace(mask=None).causal
    assert masked.replace(mask=None, causal=True).causal and masked.replace(dtype="fp32").causal
    assert plain.replace(mask=window).causal  # causal given as such stays
    assert AttentionSpec(head_dim=64, causal=True, mask={"causal": {}}).replace(mask=None).causal


def test_a_mask_tree_of_doublings_is_refused_at_once():
    # one node held twice per level: 2**40 patterns written out; counting them (not walking them out) refuses it
    from flashgen.masks.tree import MaskNode, parse_mask_tree

    node = parse_mask_tree({"sliding_window": {"left": 8, "right": 0}})
    for _ in range(40):
        node = MaskNode("and", (), (node, node))
    started = time.monotonic()
    with pytest.raises(SpecError, match=r"^spec field 'mask': the mask is 1099511627776 patterns long written out"):
        AttentionSpec(head_dim=64, mask=node)
    assert time.monotonic() - started < 5


def test_round_trip_through_yaml(tmp_path):
    spec = AttentionSpec(name="rt", dtype="bf16", head_dim=96, head_dim_v=64, num_heads=12, num_kv_heads=4,
                         softmax_scale=0.2, backward=True)
    path = tmp_path / "rt.yaml"
    path.write_text(spec.to_yaml())
    assert AttentionSpec.from_yaml(path) == spec


@pytest.mark.parametrize("field,value,words", [
    ("dtype", "fp13", "expected one of fp16, bf16, fp32, fp8_e4m3, fp8_e5m2, got 'fp13'"),
    ("head_dim", 0, "from 1 to 256, got 0"),
    ("head_dim", 257, "from 1 to 256, got 257"),
    ("head_dim", "128", "expected an integer, got '128'"),
    ("head_dim", True, "expected an integer, got True"),
    ("head_dim_v", 300, "got 300"),
    ("num_heads", 0, "got 0"),
    ("num_kv_heads", 3, "num_heads (8) must be a multiple of num_kv_heads, got 3"),
    ("causal", "yes please", "expected true or false"),
    ("softmax_scale", -1.0, "expected a positive number of at most 2.359e+38, got -1.0"),
    ("softmax_scale", 1e39, "expected a positive number of at most 2.359e+38, got 1e+39"),
    ("softmax_scale", float("nan"), "finite"),
    ("dropout_p", 1.0, "probability in [0, 1), got 1.0"),
    ("backward", 1, "expected true or false, got 1"),
    ("target", "tpu", "expected one of auto, h100"),
    ("name", "has space", "got 'has space'"),
    ("mask", {"sliding_window": 3}, "expected a mapping of parameters"),
    ("tune", [1, 2], "expected a mapping"),
])
def test_each_bad_field_names_field_and_value(field, value, words):
    data = {"name": "x", "head_dim": 64, "num_heads": 8, field: value}
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_dict(data)
    assert info.value.field == field or info.value.field.startswith(field + ".")  # nested: mask.sliding_window
    assert f"spec field '{info.value.field}'" in str(info.value) and words in str(info.value)
    assert words in str(info.value)


@pytest.mark.parametrize("tune,field,words", [
    ({"seqlens": []}, "tune.seqlens", "non-empty list"),
    ({"seqlens": [1024, 0]}, "tune.seqlens", "got 0"),
    ({"seqlens": 4096}, "tune.seqlens", "got 4096"),
    ({"trials": 0}, "tune.trials", "got 0"),
    ({"trails": 10}, "tune.trails", "unknown key"),
])
def test_bad_tune_section(tune, field, words):
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_dict({"tune": tune})
    assert info.value.field == field and words in str(info.value)


def test_unknown_key_is_an_error_with_the_file_name(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("head_dim: 64\ncasual: true\n")
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_yaml(path)
    assert info.value.field == "casual"
    assert str(path) in str(info.value) and "unknown key" in str(info.value)


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(SpecError, match="cannot read spec file"):
        AttentionSpec.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent("""\
        head_dim: [64
        """))
    with pytest.raises(SpecError, match="not valid YAML"):
        AttentionSpec.from_yaml(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="expected a mapping of fields"):
        AttentionSpec.from_yaml(listy)


# ----------------------------------------------------------------------------- hostile and careless YAML
def _alias_bomb(levels: int) -> str:
    """The issue's spec: each anchor an `and` of the previous one twice (2**levels leaves)."""
    lines = ["name: bomb", "head_dim: 64", "num_heads: 1", "mask:", "  and:",
             "  - &l1 {and: [{causal: true}, {causal: true}]}"]
    lines += [f"  - &l{i} {{and: [*l{i - 1}, *l{i - 1}]}}" for i in range(2, levels + 1)]
    return "\n".join(lines) + "\n"


def _one_line_error(info, path) -> str:
    text = str(info.value)
    assert "\n" not in text and str(path) in text
    return text


def test_alias_bomb_is_refused_at_once(tmp_path):
    import time

    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(25))
    assert len(path.read_bytes()) < 1000  # the issue's 782-byte file never finished parsing
    started = time.perf_counter()
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_yaml(path)
    assert "expands to more than 10000 values" in _one_line_error(info, path)
    import flashgen

    with pytest.raises(SpecError, match="expands to more than"):
        flashgen.load(str(path))  # the loader parses the same way
    assert time.perf_counter() - started < 5


def test_anchors_and_merge_keys_a_spec_may_use_still_load(tmp_path):
    path = tmp_path / "aliases.yaml"
    path.write_text(textwrap.dedent("""\
        name: shared
        head_dim: 64
        num_heads: 4
        mask:
          or:
          - &window {sliding_window: {left: 8, right: 0}}
          - and: [*window, {chunked: 16}]
        tune: &tune
          <<: {trials: 3}
          seqlens: [128]
        """))
    spec = AttentionSpec.from_yaml(path)
    assert spec.tune.trials == 3 and spec.mask.kind == "or"
    assert spec.mask.children[0] == spec.mask.children[1].children[0]
    medium = tmp_path / "medium.yaml"
    medium.write_text(_alias_bomb(8))  # 2**8 patterns: large, but a real (if silly) spec
    large = AttentionSpec.from_yaml(medium)  # (2**8 causal patterns and-ed: flash-attn's causal, the causal spec)
    assert large.causal and large.mask is None


@pytest.mark.parametrize("text,words", [
    ("name: x\nmask: " + "{and: [" * 70 + "{causal: true}" + "]}" * 70 + "\n", "nested deeper than 64 levels"),
    ("[" * 5000 + "]" * 5000 + "\n", "nested deeper than 64 levels"),  # RecursionError in PyYAML's composer
    ("mask: &a {and: [*a]}\n", "an alias refers to the value that contains it"),
    ("head_dim: [64\n", "not valid YAML"),
], ids=["deep-mask", "deep-list", "recursive-alias", "syntax"])
def test_yaml_bounds_and_syntax_errors_are_one_line_spec_errors(tmp_path, text, words):
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_yaml(path)
    assert words in _one_line_error(info, path) and info.value.field == "<file>"


def test_deep_alias_nesting_is_bounded_too(tmp_path):
    # each level is shallow in the file, deep once the aliases are copied out
    lines = ["mask:", "  and:", "  - &l0 {causal: true}"]
    lines += [f"  - &l{i} {{and: [{{and: [{{and: [*l{i - 1}]}}]}}]}}" for i in range(1, 30)]
    path = tmp_path / "deep-alias.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecError, match="nests deeper than 64 levels"):
        AttentionSpec.from_yaml(path)


def _nested(depth: int, leaf, wrap):
    for _ in range(depth):
        leaf = wrap(leaf)
    return leaf


@pytest.mark.parametrize("field,value", [
    ("mask", "~" * 400 + "(q_idx >= kv_idx)"),
    ("mask", " & ".join(["(q_idx >= kv_idx)"] * 400)),
    ("mask", _nested(600, {"causal": True}, lambda m: {"and": [m, {"causal": True}]})),
    ("score_mod", "score" + " + 1.0" * 400),
], ids=["not-400", "and-400", "dict-600", "score-400"])
def test_deep_expressions_are_a_spec_error_not_a_recursion_error(field, value):
    with pytest.raises(SpecError) as info:
        AttentionSpec(**{field: value})
    assert info.value.field.split(".")[0] == field and "nested too deeply" in str(info.value)


@pytest.mark.parametrize("text,field", [
    ("name: a\nhead_dim: 64\nname: b\n", "name"),
    ("tune:\n  trials: 3\n  trials: 4\n", "trials"),
], ids=["top", "nested"])
def test_duplicate_keys_are_refused_naming_the_key(tmp_path, text, field):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_yaml(path)
    assert info.value.field == field and f"duplicate key '{field}'" in _one_line_error(info, path)


def test_non_utf8_and_oversized_spec_files(tmp_path):
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_yaml(latin)
    assert "not UTF-8 text (byte 0xe9 at offset 9)" in _one_line_error(info, latin)
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 110_000)
    with pytest.raises(SpecError, match="larger than 1048576 bytes"):
        AttentionSpec.from_yaml(big)
    with pytest.raises(SpecError, match="cannot read spec file: Is a directory"):
        AttentionSpec.from_yaml(tmp_path)


@pytest.mark.parametrize("text,field", [
    ("1: x\nfoo: y\n", "1"),
    ("foo: y\n1: x\n", "foo"),  # the first unknown key in the file
    ("tune: {foo: y, 1: x}\n", "tune.foo"),
], ids=["int-first", "str-first", "tune"])
def test_unknown_keys_of_mixed_types(tmp_path, text, field):
    path = tmp_path / "mixed.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        AttentionSpec.from_yaml(path)
    assert info.value.field == field and "unknown key" in str(info.value)


@pytest.mark.parametrize("name", ["foo\n", "a" * 101, "", "-lead", "sp ace"],
                         ids=["newline", "101-chars", "empty", "dash", "space"])
def test_names_that_cannot_name_a_file_are_refused(name):
    with pytest.raises(SpecError) as info:
        AttentionSpec(name=name)
    assert info.value.field == "name" and "up to 100 letters" in str(info.value)


def test_longest_name_still_makes_a_valid_file_name():
    spec = AttentionSpec(name="a" * 100, head_dim=256, head_dim_v=200, num_heads=64, num_kv_heads=8,
                         softmax_scale=0.123456, dropout_p=0.125, backward=True)
    assert len(spec.uri.encode()) < 200


def test_bad_values_are_quoted_short():
    with pytest.raises(SpecError) as info:
        AttentionSpec(name="x" * 100_000)
    assert len(str(info.value)) < 400 and "xxx...xxx" in str(info.value)


# ----------------------------------------------------------------------------- plain field values
_MARK = "__import__('sys').modules.__setitem__('flashgen_pwned', 1)"


def _code_in_repr(base):
    """A subclass of base whose repr, str and format are code: written into a generated module it would run."""

    class CodeInRepr(base):
        def __repr__(self):
            return f"{_MARK} or {base.__repr__(self)}"

        __str__ = __repr__

        def __format__(self, spec):
            return repr(self)

    return CodeInRepr


_IntCode, _FloatCode = _code_in_repr(int), _code_in_repr(float)


class _StrCode(str):
    def lower(self):
        return _StrCode(str.lower(self))


def test_every_field_is_stored_as_a_plain_value():
    spec = AttentionSpec(name=_StrCode("x"), dtype=_StrCode("fp16"), head_dim=_IntCode(32), head_dim_v=_IntCode(16),
                         num_heads=_IntCode(4), num_kv_heads=_IntCode(2), softmax_scale=_FloatCode(0.5),
                         dropout_p=_IntCode(0), target=_StrCode("CPU"),
                         tune={"seqlens": [_IntCode(64)], "trials": _IntCode(2), "batch_tokens": _IntCode(128)})
    for name, want in (("name", str), ("dtype", str), ("head_dim", int), ("head_dim_v", int), ("num_heads", int),
                       ("num_kv_heads", int), ("softmax_scale", float), ("dropout_p", float), ("target", str)):
        assert type(getattr(spec, name)) is want, name
    assert [type(v) for v in (*spec.tune.seqlens, spec.tune.trials, spec.tune.batch_tokens)] == [int, int, int]
    assert AttentionSpec(softmax_scale=_IntCode(2)).softmax_scale == 2.0
    text = spec.uri + spec.key + spec.to_yaml() + repr(spec.canonical())
    assert "__import__" not in text
    with pytest.raises(SpecError, match="softmax_scale.*finite"):
        AttentionSpec(softmax_scale=10 ** 400)


def test_an_integer_past_64_bits_gets_its_fields_range():
    # it got "expected an integer from -9223372036854775808 to 9223372036854775807 (64 bits)" for num_heads
    with pytest.raises(SpecError, match=r"'num_heads': expected an integer from 1 to 65535, got 99999999999999999999"):
        AttentionSpec(name="x", dtype="fp16", head_dim=64, num_heads=99999999999999999999)


def test_tensor_names_that_are_call_arguments_are_refused():
    # a spec whose tensor is named like an argument of the calls that take its tensors by keyword could
    # never be called (decode(..., num_splits=t) read t as the split count; q_descale=t as a descale)
    import inspect
    import re

    import flashgen
    from flashgen import kvcache
    from flashgen.api import AttentionKernel
    from flashgen.expr.ir import CALL_ARGUMENTS
    def takes_tensors(f):
        return callable(f) and any(p.kind == p.VAR_KEYWORD for p in inspect.signature(f).parameters.values())
    methods = [getattr(AttentionKernel, n) for n in dir(AttentionKernel) if n == "__call__" or not n.startswith("_")]
    calls = [flashgen.attention, flashgen.attention_varlen, kvcache.decode, *filter(takes_tensors, methods)]
    assert {f.__name__ for f in calls} >= {"__call__", "forward", "backward", "varlen", "block_map"}
    arguments = {p.name for f in calls for p in inspect.signature(f).parameters.values()
                 if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    assert arguments <= CALL_ARGUMENTS, sorted(arguments - CALL_ARGUMENTS)
    for fields, where in (({"mask": "num_splits[kv_idx] != 0"}, "mask.expr"),
                          ({"score_mod": "score + q_descale[h]"}, "score_mod.expr"),
                          ({"mask": {"prefix_lm": {"prefix": "out"}}}, "mask.prefix_lm.prefix"),
                          ({"score_mod": {"alibi": {"slopes": "k"}}}, "score_mod.alibi.slopes")):
        with pytest.raises(SpecError, match=f"spec field '{re.escape(where)}'.*an argument of the calls"):
            AttentionSpec(head_dim=16, **fields)


def test_the_spec_s_scale_limit_is_the_kernels():
    # spec.py writes host.py's SCALE_LIMIT again (reading a spec imports no torch; host.py imports nothing from
    # flashgen): the two must agree
    from flashgen import spec
    from flashgen.runtime import host

    assert spec.SCALE_LIMIT == host.SCALE_LIMIT
