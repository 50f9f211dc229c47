"""Shared test helpers: fresh random inputs, output buffers poisoned with NaN, child processes."""

import gc
import itertools
import os

import pytest
import torch

# Tests of the Hopper-only kernels (the Gluon families: warp-specialized forward and backward, FP8, the FP8-cache
# decode): skipped where no sm90 GPU (H100/H200) is.
sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="needs an sm90 GPU (H100/H200)")


class FreshBuffers:
    """torch.empty and torch.empty_like patched (through monkeypatch, for the test) to fill what they make while
    `garbage` is set: True, garbage (NaN; a bool True; an integer a third of its type's max), False, zeros; None (at
    first), left as made. `count`: how many buffers were filled. A kernel that reads an element of a buffer that
    nothing wrote then reads garbage, whatever the allocator's memory held before (zeros, on a fresh GPU process)."""

    def __init__(self, monkeypatch):
        self.garbage, self.count = None, 0
        empty, empty_like = torch.empty, torch.empty_like
        monkeypatch.setattr(torch, "empty", lambda *a, **kw: self.fill(empty(*a, **kw)))
        monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: self.fill(empty_like(*a, **kw)))

    def fill(self, t):
        if self.garbage is not None and t.numel() and t.device.type != "meta":
            self.count += 1
            if t.dtype.is_floating_point:
                t.fill_(float("nan") if self.garbage else 0.0)
            elif t.dtype == torch.bool:
                t.fill_(self.garbage)
            else:
                t.fill_(torch.iinfo(t.dtype).max // 3 if self.garbage else 0)
        return t


def forget_plans():
    """The call plans of dense, packed and decode calls (flashgen.attention's, each kernel object's own fast
    path's, the modules' launchers'), and the split decode's shared partials: what may hold a buffer made at an
    earlier call for the cases here (a custom mask's cached block maps are not among them)."""
    from flashgen import api, kvcache, ops
    from flashgen.runtime import decode

    api._FAST.clear()
    # (type(), not isinstance: the heap holds weak proxies, which raise ReferenceError once their object is gone)
    for kernel in [o for o in gc.get_objects() if issubclass(type(o), api.AttentionKernel)]:
        kernel._fast.clear()
    decode.PARTS.clear()
    decoders = [*kvcache._LAUNCHERS.values(), *kvcache._COMPAT.values()]
    for module in list(ops._MODULES.values()):
        module._LAUNCHER.plans.clear()
        decoders.append(module._DECODE)
    for launcher in decoders:
        launcher.calls.clear()
        launcher.reads.clear()
        launcher.lengths.clear()


def portable_config(spec, seqlen, **knobs):
    """The H100 default config of spec at seqlen on the portable family throughout (pointer loads, no warp
    specialization, the multi-launch backward), with knobs replaced."""
    from flashgen import default_config

    return default_config(spec, "h100", seqlen, hopper_ws=False).replace(
        bwd_short=False, family="portable", tma=False, warp_specialize=False, **knobs)


def gluon_configs(spec, seqlen):
    """portable_config with each Gluon (sm90) kernel in turn, by name: the forward (O stored from registers), the
    dK/dV kernel, and the dK/dV kernel adding dQ itself."""
    portable = portable_config(spec, seqlen)
    return {
        "gluon forward": portable.replace(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2,
                                          hopper_tma_store=False),
        "gluon dK/dV": portable.replace(hopper_bwd=True),
        "gluon dK/dV adding dQ": portable.replace(hopper_bwd=True, dq_strategy="atomic", bwd_fused_delta=False),
    }


def make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v=None, *, dtype, device,
             layout="bhsd", generator=None):
    """Fresh randn q, k, v in the given layout (bhsd or bshd)."""
    head_dim_v = head_dim_v or head_dim

    def randn(b, h, s, d):
        shape = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)

    return (randn(batch, heads, seqlen_q, head_dim), randn(batch, kv_heads, seqlen_k, head_dim),
            randn(batch, kv_heads, seqlen_k, head_dim_v))


def cu_seqlens(lengths, device):
    """Packed sequences' int32 offsets (batch + 1, from 0) for these sequence lengths."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def packed_plans(call):
    """call()'s result and the packed-sequence plans of the Gluon forward (HopperPlan.packed) it made: the plans of
    the kernel modules loaded in this process are forgotten first (a later call makes them again)."""
    from flashgen import ops
    from flashgen.runtime.hopper import HopperPlan

    for module in list(ops._MODULES.values()):
        module._LAUNCHER.plans.clear()
    result = call()
    return result, [plan for module in list(ops._MODULES.values()) for plan in list(module._LAUNCHER.plans.values())
                    if isinstance(plan, HopperPlan) and plan.packed]


def poisoned_outputs(q, heads, seqlen_q, head_dim_v, layout):
    """NaN-filled out and lse buffers, so an element the kernel never writes fails the check."""
    batch = q.shape[0]
    shape = (batch, heads, seqlen_q, head_dim_v) if layout == "bhsd" else (batch, seqlen_q, heads, head_dim_v)
    out = torch.full(shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((batch, heads, seqlen_q), float("nan"), dtype=torch.float32, device=q.device)
    return out, lse


def child_pythonpath(*first) -> str:
    """PYTHONPATH for a child process: `first`, then whatever this process was given."""
    return os.pathsep.join([*map(str, first), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def half_fractions(binary_factors, rows):
    """(row index, row, *combination) for each of `rows` with half of the combinations of the
    two-level `binary_factors`: those of one parity, the parity alternating from row to row. Every
    row meets each level of each factor, and any two factors meet in all four combinations, for half
    the cases of the whole product (a resolution-III design per row; with two or more rows both
    halves run, so the whole product is covered across rows)."""
    combos = list(itertools.product(*binary_factors))
    halves = [[c for i, c in enumerate(combos) if bin(i).count("1") % 2 == parity] for parity in (0, 1)]
    return [(m, row, *combo) for m, row in enumerate(rows) for combo in halves[m % 2]]


def drop_all_tables(url):
    """Every table of a database: flashgen's, Optuna's and both Alembic version tables."""
    from sqlalchemy import MetaData, create_engine

    engine = create_engine(url)
    tables = MetaData()
    tables.reflect(engine)
    tables.drop_all(engine)
    engine.dispose()
