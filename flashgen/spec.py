"""AttentionSpec: what attention the user wants, from YAML or Python.

A spec is frozen and validated on construction. Every bad field raises a
SpecError that names the field and the value, for example::

    spec field 'head_dim': expected an integer from 1 to 256, got 0

``spec.uri`` is a readable, filename-safe id (``gqa-causal_bf16_hd128_h32kv8_causal_train``)
of at most MAX_URI_LENGTH characters (a long one ends in a hash of the rest);
``spec.key`` is a hash of the canonical form of the computation (every field but
``name``, ``target`` and ``tune``, which do not change what the kernel computes).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from . import masks
from .errors import SpecError
from .expr.parse import plain_number, plain_str
from .masks.pattern import check_bool
from .masks.tree import CAUSAL, check_written_size, split_causal

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp8_e4m3": "float8_e4m3fn",
          "fp8_e5m2": "float8_e5m2"}
FP8_DTYPES = ("fp8_e4m3", "fp8_e5m2")  # Q/K/V in FP8 with fp32 descales; forward only, output in bf16
_DTYPE_ALIASES = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "fp8_e4m3": "fp8_e4m3", "e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2",
}
TARGETS = ("auto", "h100", "h200", "a100", "l40s", "l4", "a10g", "rtx4090", "rtx3090", "cpu")
MAX_HEAD_DIM = 256
MAX_NAME_LENGTH = 100  # the name starts spec.uri, which names files: keep it far below 255 bytes
# spec.uri names cache files, tuner studies and database rows (256 characters at most), and an
# or-tree of masks grows it without bound: past MAX_URI_LENGTH it keeps a readable prefix and
# replaces the rest with a hash of the whole, so distinct long ids stay distinct.
_URI_PREFIX, _URI_HASH = 80, 16
MAX_URI_LENGTH = _URI_PREFIX + 1 + _URI_HASH
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # used with fullmatch: `$` would accept "foo\n"

# What a spec file may be. Specs are a few hundred bytes; the bounds stop a small hostile
# file from hanging or crashing the reader (nested aliases expand exponentially, deep
# nesting exhausts Python's stack) long before any real spec comes near them.
MAX_SPEC_BYTES = 1 << 20
MAX_SEQLEN = 1 << 20  # the longest tune.seqlens bucket (and `flashgen tune --seqlens` length)
MAX_TRIALS = 100_000  # tune.trials and `flashgen tune --trials`
# the largest softmax_scale the kernels' float32 scale x log2(e) holds: runtime/host.py's SCALE_LIMIT, written
# again so that reading a spec imports no torch (host.py imports nothing from flashgen; a test keeps them equal)
SCALE_LIMIT = 3.4028234663852886e38 / 1.4426950408889634
MAX_SPEC_VALUES = 10_000  # scalars, lists and mappings, counting every alias expansion
MAX_YAML_DEPTH = 64


# ----------------------------------------------------------------------------- YAML reading
class YamlFileError(ValueError):
    """A YAML file cannot be read, decoded or parsed, or is past a size bound. ``key`` is set
    for a duplicate key; the message is one line and names the file."""

    def __init__(self, path: str, problem: str, key: Any = None):
        self.path, self.problem, self.key = path, problem, key
        super().__init__(f"{path}: {problem}")


class _LimitError(yaml.YAMLError):
    def __init__(self, problem: str, mark, key: Any = None):
        self.problem, self.mark, self.key = problem, mark, key
        super().__init__(problem)


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses duplicate keys, nesting deeper than ``max_depth`` and
    documents that expand, through &anchors and *aliases, to more than ``max_values`` values."""

    max_depth = MAX_YAML_DEPTH
    max_values = MAX_SPEC_VALUES

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1  # the composer recurses once per level: bound it before Python's stack does
        try:
            if self._depth > self.max_depth:
                raise _LimitError(f"nested deeper than {self.max_depth} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        _check_expansion(node, self.max_values, self.max_depth)
        return node

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` overrides on purpose
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable: the base constructor says so
                continue
            if duplicate:
                raise _LimitError(f"duplicate key {key!r}", key_node.start_mark, key=key)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _check_expansion(root, max_values: int, max_depth: int) -> None:
    """Count the values the node graph expands to (every alias copied out) without expanding it:
    an iterative depth-first walk that adds up each node's size once."""

    def children(node):
        if isinstance(node, yaml.SequenceNode):
            return node.value
        if isinstance(node, yaml.MappingNode):
            return [n for pair in node.value for n in pair]
        return []

    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_: set[int] = set()  # started, not finished: the current path from the root
    stack = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            kids = children(node)
            size[id(node)] = 1 + sum(size[id(k)] for k in kids)
            depth[id(node)] = 1 + max((depth[id(k)] for k in kids), default=0)
            open_.discard(id(node))
            if size[id(node)] > max_values:
                raise _LimitError(f"expands to more than {max_values} values through &anchors and *aliases",
                                  node.start_mark)
            if depth[id(node)] > max_depth:
                raise _LimitError(f"nests deeper than {max_depth} levels through &anchors and *aliases",
                                  node.start_mark)
        elif id(node) in open_:
            raise _LimitError("an alias refers to the value that contains it", node.start_mark)
        elif id(node) not in size:
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((k, False) for k in children(node) if id(k) not in size)


def _where(mark) -> str:
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


def canonical_key(canonical: Mapping) -> str:
    """A spec's key from its canonical mapping (AttentionSpec.key; a stored row's spec_key must be its
    canonical's): the hash of its sorted JSON; '' for a mapping JSON cannot write."""
    try:
        blob = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return ""
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_yaml(path: str | Path, *, max_bytes: int = MAX_SPEC_BYTES, max_values: int = MAX_SPEC_VALUES) -> Any:
    """The data of a YAML file, read with the bounds above; YamlFileError (one line, naming the
    file) for anything that cannot be read, is not UTF-8, is not valid YAML or breaks a bound."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):  # (opening a named pipe waits for a writer)
            raise YamlFileError(str(path), "cannot read: a named pipe or socket, not a file")
        with path.open("rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as err:
        raise YamlFileError(str(path), f"cannot read: {err.strerror or err}") from None
    except YamlFileError:  # (a ValueError: not the NUL byte's below)
        raise
    except ValueError as err:  # a NUL byte in the path
        raise YamlFileError(repr(str(path)), f"cannot read: {err}") from None
    if len(raw) > max_bytes:
        raise YamlFileError(str(path), f"larger than {max_bytes} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise YamlFileError(str(path), f"not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})") from None
    loader = type("_Loader", (_BoundedLoader,), {"max_values": max_values})
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 (a SafeLoader)
    except _LimitError as err:
        raise YamlFileError(str(path), err.problem + _where(err.mark), key=err.key) from None
    except yaml.MarkedYAMLError as err:
        problem = " ".join(p for p in (err.context, err.problem) if p)
        raise YamlFileError(str(path), f"not valid YAML: {problem}{_where(err.problem_mark)}") from None
    except yaml.YAMLError as err:
        raise YamlFileError(str(path), "not valid YAML: " + " ".join(str(err).split())) from None


# Every field is stored as a plain int, float, bool or str, never the caller's subclass: a
# subclass's __repr__ or __format__ could otherwise write code into the generated module, the
# file names and the database. plain_number reads through the base type (int.__int__).
def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(name, "expected an integer", value)
    plain = int.__int__(value)  # the field's own range first: it is the one the message should give
    if plain < lo or (hi is not None and plain > hi):
        rng = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
        raise SpecError(name, f"expected an integer {rng}", plain)
    return plain_number(name, value)


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(name, "expected a number", value)
    try:
        value = float(int.__int__(value)) if isinstance(value, int) else float.__float__(value)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise SpecError(name, "expected a finite number", value)
    return value


def _int_list(name: str, values: Any, hi: int) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or not values:
        raise SpecError(name, "expected a non-empty list of integers", values)
    return tuple(sorted(set(_check_int(name, v, 1, hi) for v in values)))


@dataclass(frozen=True)
class DecodeTuneSpec:
    """``tune.decode``: the decode shapes the tuner searches decode's knobs for (the split count,
    tiles): one study per KV-length bucket and batch bucket (flashgen/decode_space.py)."""

    kv_lengths: tuple[int, ...] = (4096, 32768)
    batches: tuple[int, ...] = (1, 8, 64)
    q_len: int = 1  # query rows per call (1: plain decode; more: speculative decoding)

    def __post_init__(self):
        object.__setattr__(self, "kv_lengths", _int_list("tune.decode.kv_lengths", self.kv_lengths, 1 << 24))
        object.__setattr__(self, "batches", _int_list("tune.decode.batches", self.batches, 1 << 16))
        object.__setattr__(self, "q_len", _check_int("tune.decode.q_len", self.q_len, 1, 256))

    @classmethod
    def from_dict(cls, data: Any) -> "DecodeTuneSpec":
        if not isinstance(data, Mapping):
            raise SpecError("tune.decode", "expected a mapping with keys " + ", ".join(_fields(cls)), data)
        unknown = [k for k in data if k not in _fields(cls)]
        if unknown:
            raise SpecError(f"tune.decode.{unknown[0]}", "unknown key (known: " + ", ".join(_fields(cls)) + ")")
        return cls(**dict(data))

    def to_dict(self) -> dict:
        return {"kv_lengths": list(self.kv_lengths), "batches": list(self.batches), "q_len": self.q_len}


@dataclass(frozen=True)
class TuneSpec:
    """The ``tune:`` section: what the tuner searches for."""

    seqlens: tuple[int, ...] = (1024, 4096)
    trials: int = 32
    batch_tokens: int = 16384  # batch * seqlen used when timing a bucket
    decode: DecodeTuneSpec | None = None  # decode's shapes, when the spec also serves decode

    def __post_init__(self):
        seqlens = self.seqlens
        if isinstance(seqlens, (str, bytes)) or not isinstance(seqlens, (list, tuple)) or not seqlens:
            raise SpecError("tune.seqlens", "expected a non-empty list of sequence lengths", seqlens)
        checked = tuple(_check_int("tune.seqlens", s, 1, MAX_SEQLEN) for s in seqlens)
        object.__setattr__(self, "seqlens", tuple(sorted(set(checked))))
        object.__setattr__(self, "trials", _check_int("tune.trials", self.trials, 1, MAX_TRIALS))
        object.__setattr__(self, "batch_tokens", _check_int("tune.batch_tokens", self.batch_tokens, 1))
        if self.decode is not None and not isinstance(self.decode, DecodeTuneSpec):
            object.__setattr__(self, "decode", DecodeTuneSpec.from_dict(self.decode))

    @classmethod
    def from_dict(cls, data: Any) -> "TuneSpec":
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise SpecError("tune", "expected a mapping with keys " + ", ".join(_fields(cls)), data)
        unknown = [k for k in data if k not in _fields(cls)]  # not sorted: keys may mix types (`1: x`)
        if unknown:
            raise SpecError(f"tune.{unknown[0]}", "unknown key (known: " + ", ".join(_fields(cls)) + ")")
        return cls(**dict(data))

    def to_dict(self) -> dict:
        out = {"seqlens": list(self.seqlens), "trials": self.trials, "batch_tokens": self.batch_tokens}
        if self.decode is not None:
            out["decode"] = self.decode.to_dict()
        return out


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _refuse_deep_nesting(post_init):
    """A mask or score_mod nested past Python's stack (a 400-level expression, a deep dict)
    is a SpecError naming the field, not a RecursionError."""

    @functools.wraps(post_init)
    def checked(self):
        try:
            post_init(self)
        except RecursionError:
            raise SpecError(_too_deep(self), "nested too deeply (split the expression, or use and/or lists)") from None

    return checked


def _too_deep(spec) -> str:
    """Which field overflowed the stack: parse each again on its own (a parsed node parses at once)."""
    for name, parse in (("mask", masks.parse_mask), ("score_mod", masks.parse_score_mod)):
        value = getattr(spec, name)
        try:
            if value is not None:
                parse(value)
        except RecursionError:
            return name
        except Exception:  # noqa: BLE001 (another error in this field: not the deep one)
            pass
    return "mask" if spec.mask is not None else "score_mod"


@dataclass(frozen=True)
class AttentionSpec:
    """One attention variant: shapes, dtype, masking, and how it is used."""

    name: str = "attention"
    dtype: str = "fp16"
    head_dim: int = 64
    head_dim_v: int | None = None  # defaults to head_dim
    num_heads: int = 1
    num_kv_heads: int | None = None  # defaults to num_heads (GQA/MQA when smaller)
    causal: bool = False
    mask: Any = None  # a pattern, an and/or of patterns, or an expression (flashgen.mask)
    score_mod: Any = None  # softcap, alibi, relative_bias, an expression, or a list applied in order
    softmax_scale: float | None = None  # defaults to 1/sqrt(head_dim)
    dropout_p: float = 0.0
    backward: bool = False
    target: str = "auto"
    tune: TuneSpec = field(default_factory=TuneSpec)
    _causal_from_mask = False  # (not a field: __post_init__ and replace() set it; see replace)

    @_refuse_deep_nesting
    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        name = plain_str(self.name) if isinstance(self.name, str) else None
        if name is None or not _NAME_RE.fullmatch(name) or len(name) > MAX_NAME_LENGTH:
            raise SpecError("name", f"expected up to {MAX_NAME_LENGTH} letters, digits, '_', '.' or '-' "
                                    "(starting with a letter or digit)", self.name)
        set_("name", name)
        dtype = _DTYPE_ALIASES.get(plain_str(self.dtype)) if isinstance(self.dtype, str) else None
        if dtype is None:
            raise SpecError("dtype", "expected one of fp16, bf16, fp32, fp8_e4m3, fp8_e5m2", self.dtype)
        set_("dtype", dtype)
        set_("head_dim", _check_int("head_dim", self.head_dim, 1, MAX_HEAD_DIM))
        if self.head_dim_v is None:
            set_("head_dim_v", self.head_dim)
        set_("head_dim_v", _check_int("head_dim_v", self.head_dim_v, 1, MAX_HEAD_DIM))
        set_("num_heads", _check_int("num_heads", self.num_heads, 1, 65535))
        if self.num_kv_heads is None:
            set_("num_kv_heads", self.num_heads)
        set_("num_kv_heads", _check_int("num_kv_heads", self.num_kv_heads, 1, 65535))
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                "num_kv_heads",
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads",
                self.num_kv_heads,
            )
        check_bool("causal", self.causal)
        if self.mask is not None:
            # a mask that is (or and-s in) flash-attn's causal pattern: stored as `causal: true` and the rest;
            # _causal_from_mask: causal came from the mask alone (replace(mask=...) replaces it with the mask)
            mask = masks.parse_mask(self.mask)
            check_written_size(mask)
            causal, rest = split_causal(mask)
            set_("_causal_from_mask", causal and not self.causal)
            set_("mask", rest)
            set_("causal", self.causal or causal)
        if self.score_mod is not None:
            set_("score_mod", masks.parse_score_mod(self.score_mod))
        if self.mask is not None or self.score_mod is not None:
            masks.lower(self.mask_node, self.score_mod)  # refuses what could not be generated
        if self.softmax_scale is not None:
            scale = _check_float("softmax_scale", self.softmax_scale)
            if not 0 < scale <= SCALE_LIMIT:  # (the kernels take scale x log2(e) in float32)
                raise SpecError("softmax_scale", f"expected a positive number of at most {SCALE_LIMIT:.4g}",
                                self.softmax_scale)
            set_("softmax_scale", scale)
        p = _check_float("dropout_p", self.dropout_p)
        if not 0.0 <= p < 1.0:
            raise SpecError("dropout_p", "expected a probability in [0, 1)", self.dropout_p)
        set_("dropout_p", p)
        check_bool("backward", self.backward)
        if dtype in FP8_DTYPES:
            if self.backward:
                raise SpecError("backward", f"dtype {dtype} is forward-only (FP8 inference, as FlashAttention-3); "
                                            "set backward: false", self.backward)
            if p > 0:
                raise SpecError("dropout_p", f"dtype {dtype} is for inference: expected 0", self.dropout_p)
        target = plain_str(self.target).lower() if isinstance(self.target, str) else None
        if target not in TARGETS:
            raise SpecError("target", "expected one of " + ", ".join(TARGETS), self.target)
        set_("target", target)
        if isinstance(self.tune, Mapping) or self.tune is None:
            set_("tune", TuneSpec.from_dict(self.tune))
        elif not isinstance(self.tune, TuneSpec):
            raise SpecError("tune", "expected a mapping", self.tune)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None) -> "AttentionSpec":
        if not isinstance(data, Mapping):
            raise SpecError("<spec>", "expected a mapping of fields", data, source=source)
        known = _fields(cls)
        for key in data:
            if key not in known:
                raise SpecError(str(key), "unknown key (known: " + ", ".join(known) + ")", source=source)
        kwargs = dict(data)
        try:
            if "tune" in kwargs:
                kwargs["tune"] = TuneSpec.from_dict(kwargs["tune"])
            return cls(**kwargs)
        except SpecError as err:
            if source is None:
                raise
            raise err.with_source(source) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "AttentionSpec":
        path = Path(path)
        try:
            data = read_yaml(path)
        except YamlFileError as err:
            if err.key is not None:
                raise SpecError(str(err.key), err.problem, source=str(path)) from None
            problem = err.problem.replace("cannot read:", "cannot read spec file:", 1)
            raise SpecError("<file>", problem, source=str(path)) from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def coerce(cls, spec: "AttentionSpec | str | Path | Mapping") -> "AttentionSpec":
        """Accept a spec, a path to a YAML spec, or a dict of fields."""
        if isinstance(spec, AttentionSpec):
            return spec
        if isinstance(spec, (str, Path)):
            if not str(spec).strip():
                raise ValueError(f"spec: expected a YAML file's path, got {str(spec)!r}")
            return cls.from_yaml(spec)
        if isinstance(spec, Mapping):
            return cls.from_dict(spec)
        raise TypeError(f"spec: expected an AttentionSpec, a YAML path or a dict, got {type(spec).__name__}")

    # ----------------------------------------------------------------- derived
    @property
    def scale(self) -> float:
        """The softmax scale actually used."""
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def fp8(self) -> bool:
        """Q, K and V in FP8 (with fp32 descale factors); the output is bf16."""
        return self.dtype in FP8_DTYPES

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, DTYPES[self.dtype])

    @property
    def mask_node(self):
        """The whole mask as one node: ``causal: true`` and the ``mask:`` section and-ed."""
        causal = CAUSAL if self.causal else None
        if causal is None or self.mask is None:
            return causal or self.mask
        return masks.MaskNode("and", (), (causal, self.mask))

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The named tensors a call passes by keyword (document ids, ALiBi slopes, ...)."""
        return tuple(t.name for t in masks.lower(self.mask_node, self.score_mod).tensors)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["tune"] = self.tune.to_dict()
        if self.mask is not None:
            out["mask"] = self.mask.to_dict()
        if self.score_mod is not None:
            out["score_mod"] = self.score_mod.to_dict()
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def canonical(self) -> dict:
        """The fields that decide what the kernel computes, in a fixed form."""
        out = self.to_dict()
        for k in ("name", "target", "tune"):
            out.pop(k)
        out["softmax_scale"] = repr(self.scale)
        return out

    @property
    def key(self) -> str:
        return canonical_key(self.canonical())

    @property
    def uri(self) -> str:
        parts = [self.name, self.dtype, f"hd{self.head_dim}"]
        if self.head_dim_v != self.head_dim:
            parts.append(f"hdv{self.head_dim_v}")
        parts.append(f"h{self.num_heads}kv{self.num_kv_heads}")
        if self.causal:
            parts.append("causal")
        if self.mask is not None:
            parts.append("mask-" + _node_name(self.mask))
        if self.score_mod is not None:
            parts.append("mod-" + "-".join(step[0] for step in self.score_mod.steps))
        if self.softmax_scale is not None:
            parts.append(f"scale{self.softmax_scale:g}")
        if self.dropout_p:
            parts.append(f"drop{self.dropout_p:g}")
        parts.append("train" if self.backward else "fwd")
        return _bounded("_".join(parts))

    def replace(self, **changes) -> "AttentionSpec":
        """This spec with some fields changed. A new mask replaces the whole old one, the causal bound it
        became (`mask: {causal: {}}` is stored as `causal: true`) included, unless causal is given too."""
        from_mask = self._causal_from_mask and "causal" not in changes
        if from_mask and "mask" in changes:
            changes["causal"] = False
        spec = dataclasses.replace(self, **changes)
        if from_mask and "mask" not in changes:
            object.__setattr__(spec, "_causal_from_mask", True)
        return spec


def _node_name(node) -> str:
    if node.kind in ("and", "or"):
        return node.kind + "-" + "-".join(_node_name(c) for c in node.children)
    return node.kind


def _bounded(uri: str) -> str:
    """uri, or past MAX_URI_LENGTH its first _URI_PREFIX characters, '-' and _URI_HASH hex digits
    of the whole uri's hash: as readable as fits, and distinct long ids stay distinct."""
    if len(uri) <= MAX_URI_LENGTH:
        return uri
    return uri[:_URI_PREFIX].rstrip("-_.") + "-" + hashlib.sha256(uri.encode()).hexdigest()[:_URI_HASH]
