"""AttentionSpec: loading, defaults, identity, and one clear error per bad field."""

import textwrap
from pathlib import Path

import pytest

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


def test_round_trip_through_yaml(tmp_path):
    spec = AttentionSpec(name="rt", dtype="bf16", head_dim=96, head_dim_v=64, num_heads=12, num_kv_heads=4,
                         softmax_scale=0.2, backward=True)
    path = tmp_path / "rt.yaml"
    path.write_text(spec.to_yaml())
    assert AttentionSpec.from_yaml(path) == spec


@pytest.mark.parametrize("field,value,words", [
    ("dtype", "fp13", "expected one of fp16, bf16, fp32, got 'fp13'"),
    ("head_dim", 0, "from 1 to 256, got 0"),
    ("head_dim", 257, "from 1 to 256, got 257"),
    ("head_dim", "128", "expected an integer, got '128'"),
    ("head_dim", True, "expected an integer, got True"),
    ("head_dim_v", 300, "got 300"),
    ("num_heads", 0, "got 0"),
    ("num_kv_heads", 3, "num_heads (8) must be a multiple of num_kv_heads, got 3"),
    ("causal", "yes please", "expected true or false"),
    ("softmax_scale", -1.0, "expected a positive number, got -1.0"),
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
