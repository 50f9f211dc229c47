"""Sequences whose row offsets pass 2^31 elements: a row index times its row stride wraps in int32
(bshd with 16 heads x 128 past 1M tokens; packed 'thd' batches of 32 heads x 128 past 512K tokens),
so every kernel computes those products in int64. Each call here is cheap (a 256-key window, or
short packed sequences) but its tensors are large; the rows checked are the farthest from the base
pointer, against the reference of the small problem they form, on fresh random inputs.

Dense: a sliding window over N = 1.1M tokens, dO zero but for the last R query rows, so the
gradients are the small problem's: queries [N - R, N) over keys [N - R - W, N); every other dK/dV
row is 0. Run through the default config and the portable and Gluon backward kernels (both dQ
strategies), each forward and backward."""

import functools
import gc
import os
import random

import pytest
import torch

import flashgen
from flashgen import AttentionSpec
from flashgen.verify import assert_attention_close, assert_gradients_close

from .helpers import FreshBuffers, gluon_configs, packed_plans, portable_config

pytestmark = pytest.mark.gpu



def needs_memory(gib):
    """Skip unless the GPU has `gib` GiB free now (tensors of 4.5 GB each; `pytest -m gpu -n 14` runs
    other tests beside these: run this file alone to be sure it runs)."""
    def mark(test):
        def run(*args, **kwargs):
            release()  # the previous case's tensors, and the memory torch's allocator keeps for them
            if not torch.cuda.is_available() or torch.cuda.mem_get_info()[0] < gib * 2**30:
                pytest.skip(f"needs a CUDA GPU with {gib} GiB free")
            short = None
            try:
                return test(*args, **kwargs)
            except torch.OutOfMemoryError as err:
                if not os.environ.get("PYTEST_XDIST_WORKER"):  # alone, it is the test's (or flashgen's) memory
                    raise
                # under pytest-xdist the tests beside it took the memory meanwhile (-n 14: it happens)
                short = str(err).splitlines()[0][:120]
            finally:
                release()
            # skipped outside the except clause: an exception raised in it chains the OOM error, whose traceback
            # holds the test's frame, and with it tens of GiB of tensors that this worker's later tests lacked
            # (a mask test beside it ran out of memory with 34 GiB held here)
            pytest.skip(f"needs {gib} GiB of GPU memory, taken by other tests during the test: run this file "
                        f"alone ({short})")
        return functools.wraps(test)(run)
    return mark


def release():
    """Free what the tests of this file left: their tensors (collected), then the cache torch's allocator keeps."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

W, R = 256, 512  # window (keys left of the diagonal) and the query rows checked
WINDOW = {"sliding_window": {"left": W, "right": 0}}


def nonfinite_sequences(t, length):
    """The first few indices of t's sequences (its rows in runs of `length`) holding a NaN or an infinity, and
    how many there are (session 59's suite run met a non-finite out in an unchecked sequence here)."""
    sums = t.detach().reshape(-1, length * t[0].numel()).sum(dim=1, dtype=torch.float32)  # (NaN and inf carry)
    bad = (~torch.isfinite(sums)).nonzero().flatten()
    return (bad[:8].tolist(), len(bad)) if len(bad) else None


def fresh(*shape, gen):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)


def dense_configs():
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=16, mask=WINDOW, backward=True)
    configs = {"default": None, "portable": portable_config(spec, 4096)}
    if torch.cuda.get_device_capability() == (9, 0):
        # the Gluon forward storing O from registers (the default stores it by TMA), then the Gluon dK/dV
        configs.update(gluon_configs(spec, 4096))
    return configs


@needs_memory(50)
@pytest.mark.parametrize("name", ["default", "portable", "gluon forward", "gluon dK/dV", "gluon dK/dV adding dQ"])
def test_dense_rows_past_2_31_elements(name):
    configs = dense_configs()
    if name not in configs:
        pytest.skip("the Gluon kernels need an sm90 GPU")
    seed = random.randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, heads, d = 1_100_000, 16, 128
    q, k, v = (fresh(1, n, heads, d, gen=gen).requires_grad_() for _ in range(3))
    assert (n - 1) * heads * d > 2**31
    out = flashgen.attention(q, k, v, layout="bshd", mask=WINDOW, config=configs[name])
    do = torch.zeros_like(out)
    do[:, -R:] = fresh(1, R, heads, d, gen=gen)
    out.backward(do)
    keys = slice(n - R - W, n)
    small = [t.detach()[:, s] for t, s in ((q, slice(n - R, n)), (k, keys), (v, keys))]
    try:
        assert_attention_close(out.detach()[:, -R:], None, *small, causal=False, layout="bshd", mask=WINDOW)
        grads = (q.grad[:, -R:], k.grad[:, keys], v.grad[:, keys])
        assert_gradients_close(grads, *small, do[:, -R:], causal=False, layout="bshd", mask=WINDOW)
        assert torch.isfinite(out).all()
        # the rows no nonzero dO reaches: dQ and dK/dV exactly 0
        assert not q.grad[:, : n - R].any() and not k.grad[:, : n - R - W].any() and not v.grad[:, : n - R - W].any()
    except AssertionError as err:
        raise AssertionError(f"{name}, seed {seed}: {err}") from None


@pytest.mark.parametrize("causal, longest", [(True, 1000), (False, 1000), (False, 1024)],
                         ids=["causal", "one length", "max_seqlen past it"])
@needs_memory(36)
def test_packed_rows_past_2_31_elements(causal, longest, monkeypatch):
    # 540 sequences of 1000 tokens, 32 query heads over 8 KV heads: q, out, dO and dQ hold more than
    # 2^31 elements and the last sequences start past them (cu_seqlens' offset times the row stride).
    # Non-causal on an sm90 GPU: the Gluon forward's persistent packed kernel for these sequences of one length; where
    # max_seqlen (1024) says the lengths may differ, the one-tile packed kernel (which faulted here beside other
    # tests' processes while its partitions took the sequence bounds through shared memory: sessions 61-63); causal
    # sequences this short, the portable forward
    seed = random.randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    count, length, heads, kv_heads, d = 540, 1000, 32, 8, 128
    total = count * length
    q = fresh(total, heads, d, gen=gen).requires_grad_()
    k, v = (fresh(total, kv_heads, d, gen=gen).requires_grad_() for _ in range(2))
    assert (total - length) * heads * d > 2**31
    cu = torch.arange(0, total + 1, length, device="cuda", dtype=torch.int32)
    # flashgen's buffers (out, LSE, dQ, dK, dV, delta, ...) NaN until written, so a read of an element nothing wrote
    # shows whatever the memory held before (a run beside other tests met a non-finite out, session 59)
    FreshBuffers(monkeypatch).garbage = True
    out, plans = packed_plans(lambda: flashgen.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal))
    gluon = not causal and torch.cuda.get_device_capability() == (9, 0)
    assert [plan.cfg["hopper_persistent"] for plan in plans] == ([longest == length] if gluon else [])
    forward_bad = nonfinite_sequences(out, length)  # (read before the backward runs: which of the two wrote it)
    do = fresh(total, heads, d, gen=gen)
    out.backward(do)
    bad = {"out after the forward": forward_bad, "out after the backward": nonfinite_sequences(out, length),
           "dq": nonfinite_sequences(q.grad, length), "dk": nonfinite_sequences(k.grad, length),
           "dv": nonfinite_sequences(v.grad, length)}
    assert not any(bad.values()), f"seed {seed}: non-finite values in sequences {bad}"
    try:
        for i in (0, count - 2, count - 1):  # the first sequence, and the two farthest
            rows = slice(i * length, (i + 1) * length)
            seq = [t.detach()[rows].transpose(0, 1)[None] for t in (q, k, v)]  # (1, heads, length, d)
            assert_attention_close(out.detach()[rows].transpose(0, 1)[None], None, *seq, causal=causal)
            grads = tuple(t.grad[rows].transpose(0, 1)[None] for t in (q, k, v))
            assert_gradients_close(grads, *seq, do[rows].transpose(0, 1)[None], causal=causal)
    except AssertionError as err:
        raise AssertionError(f"seed {seed}: {err}") from None
