"""Packed sequences on a GPU: a training step reads nothing back from the device (the offsets are
checked by a kernel that writes the bounds record, AttentionLauncher.check_offsets), a call with bad
offsets never reads or writes outside its tensors, and the error naming the argument comes from the
first packed call after the check has run (or flashgen.check_bounds()); against the reference on fresh
random inputs."""

import random
import re

import pytest
import torch

import flashgen
from flashgen.verify import assert_attention_close, assert_gradients_close

from .helpers import cu_seqlens

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def packed(lengths, heads=4, kv_heads=2, d=64, gen=None):
    total = sum(lengths)
    q = torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(total, kv_heads, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    cu = cu_seqlens(lengths, "cuda")
    return q, k, v, cu


@needs_gpu
def test_a_packed_training_step_reads_nothing_back():
    seed = random.randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [100, 1, 333, 64]
    q, k, v, cu = packed(lengths, gen=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flashgen.attention_varlen(*leaves, cu, cu, 333, 333, causal=True)  # first call: plans, compiles
    do = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a device->host copy or a wait raises
    try:
        out = flashgen.attention_varlen(*leaves, cu, cu, 333, 333, causal=True)
        out.backward(do)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    flashgen.check_bounds()  # nothing recorded
    try:
        for i, n in enumerate(lengths):  # each sequence against the reference
            rows = slice(int(cu[i]), int(cu[i + 1]))
            seq = [t[rows].transpose(0, 1)[None] for t in (q, k, v)]
            assert_attention_close(out.detach()[rows].transpose(0, 1)[None], None, *seq, causal=True)
            grads = tuple(t.grad[rows].transpose(0, 1)[None] for t in leaves)
            assert_gradients_close(grads, *seq, do[rows].transpose(0, 1)[None], causal=True)
    except AssertionError as err:
        raise AssertionError(f"seed {seed}: {err}") from None


@needs_gpu
@pytest.mark.parametrize("bad, message", [
    ([0, 100, 50, 197], "cu_seqlens_k: expected nondecreasing offsets, got 100 then 50 at index 1"),
    ([0, 100, 101, 9000], "cu_seqlens_k: expected offsets within the 197 tokens of k, got last offset 9000"),
    ([5, 100, 101, 197], "cu_seqlens_k: expected the first offset to be 0, got 5"),
    ([0, 1, 2, 197], "max_seqlen_k: expected at least the longest sequence (195 tokens, cu_seqlens_k[3] - "
                     "cu_seqlens_k[2]), got 100"),
])
def test_bad_offsets_raise_at_the_next_packed_call(bad, message):
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))
    q, k, v, cu = packed([100, 1, 96], gen=gen)
    cu_bad = torch.tensor(bad, device="cuda", dtype=torch.int32)
    out = flashgen.attention_varlen(q, k, v, cu, cu_bad, 100, 100)  # clamped: no fault, no wait
    assert out.shape == q.shape
    torch.cuda.synchronize()  # the check has run (with the host ahead, a later call raises)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        flashgen.attention_varlen(q, k, v, cu, cu, 100, 100)  # the next packed call reads the record
    flashgen.attention_varlen(q, k, v, cu, cu, 100, 100)  # the record was cleared
    flashgen.attention_varlen(q, k, v, cu, cu_bad, 100, 100)
    with pytest.raises(ValueError, match="cu_seqlens_k|max_seqlen_k"):
        flashgen.check_bounds()  # the explicit sync point
    flashgen.check_bounds()


@needs_gpu
def test_sync_checks_raise_in_the_bad_call(monkeypatch):
    # FLASHGEN_SYNC_CHECKS=1 (debugging): the offsets are read on the host, the bad call raises itself
    from flashgen.runtime.host import AttentionLauncher

    monkeypatch.setattr(AttentionLauncher, "SYNC_CHECKS", True)
    q, k, v, cu = packed([100, 1, 96], gen=torch.Generator(device="cuda").manual_seed(0))
    bad = torch.tensor([0, 100, 50, 197], device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: expected nondecreasing offsets, got 100 then 50 at index 1$"):
        flashgen.attention_varlen(q, k, v, cu, bad, 100, 100)
    flashgen.check_bounds()  # nothing was recorded: no kernel checked
