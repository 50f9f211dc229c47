"""Named tensors are made from what the spec says they are (the pattern or modifier parameter
that names them, or how a custom expression reads them), never from their names."""

import pytest
import torch

import flashgen
from flashgen import AttentionSpec
from flashgen.inputs import named_tensors, qkv_do
from flashgen.verify import check_attention

# Names that mean something else elsewhere: document ids called `lengths`, ALiBi slopes
# called `ids`, prefix lengths called `document_ids`, a bias table called `alibi_slopes`.
DOCS_AS_LENGTHS = AttentionSpec(name="docs", dtype="fp32", head_dim=16, num_heads=2,
                                mask={"document": {"ids": "lengths", "causal": True}})
ALIBI_AS_IDS = AttentionSpec(name="alibi", dtype="fp32", head_dim=16, num_heads=4, causal=True,
                             score_mod={"alibi": {"slopes": "ids"}})


def test_document_ids_named_lengths():
    (ids,) = named_tensors(DOCS_AS_LENGTHS, 3, 50, device="cpu").values()
    assert ids.dtype == torch.int32 and ids.shape == (3, 50)
    assert (ids.diff(dim=1) >= 0).all() and ids[:, 0].eq(0).all() and ids.max() == 3  # 4 equal documents
    gen = torch.Generator().manual_seed(0)
    ids = named_tensors(DOCS_AS_LENGTHS, 3, 50, device="cpu", generator=gen)["lengths"]
    assert (ids.diff(dim=1) >= 0).all() and (ids.diff(dim=1) <= 1).all() and ids[:, 0].eq(0).all()
    assert not torch.equal(ids[0], ids[1])  # random cuts: each batch element its own documents


def test_alibi_slopes_named_ids():
    (slopes,) = named_tensors(ALIBI_AS_IDS, 2, 20, device="cpu").values()
    assert slopes.dtype == torch.float32 and slopes.shape == (4,)
    assert torch.allclose(slopes, torch.tensor([2 ** (-2.0), 2 ** (-4.0), 2 ** (-6.0), 2 ** (-8.0)]))


def test_prefix_lengths_and_bias_table_under_other_names():
    spec = AttentionSpec(name="both", dtype="fp32", head_dim=16, num_heads=3, mask={"prefix_lm": "document_ids"},
                         score_mod={"relative_bias": "alibi_slopes"})
    gen = torch.Generator().manual_seed(1)
    t = named_tensors(spec, 5, 9, 30, device="cpu", generator=gen)
    prefix, bias = t["document_ids"], t["alibi_slopes"]
    assert prefix.dtype == torch.int32 and prefix.shape == (5,) and prefix.min() >= 0 and prefix.max() <= 30
    assert bias.dtype == torch.float32 and bias.shape == (3, 9 + 30 - 1)  # every distance q - kv + Sk - 1
    assert named_tensors(spec, 5, 30, device="cpu")["document_ids"].tolist() == [15] * 5  # fixed: half


def test_custom_expression_tensors_by_rank_extent_and_use():
    spec = AttentionSpec(name="custom", dtype="fp32", head_dim=16, num_heads=2,
                         mask="seg[b, q_idx] == seg[b, kv_idx]",
                         score_mod="score + table[h, abs(q_idx - kv_idx) // 2] * w[(kv_idx % 5) + 1]")
    t = named_tensors(spec, 3, 10, 21, device="cpu")
    # read by the mask: int32 positions; by the modifier only: float randn
    assert t["seg"].dtype == torch.int32 and t["seg"].shape == (3, 21)
    assert t["seg"].min() >= 0 and t["seg"].max() <= 21
    assert t["table"].dtype == torch.float32 and t["table"].shape == (2, 11)  # |q - kv| // 2 <= 20 // 2
    assert t["w"].shape == (6,)  # (kv % 5) + 1 <= 5


@pytest.mark.parametrize("spec", [DOCS_AS_LENGTHS, ALIBI_AS_IDS], ids=["document-lengths", "alibi-ids"])
def test_generated_inputs_run_and_match_the_reference(spec, device):
    gen = torch.Generator().manual_seed(2)
    q, k, v, _ = qkv_do(spec, 2, 23, 23, device=device, generator=gen)
    named = named_tensors(spec, 2, 23, device=device, generator=gen)
    out, lse = flashgen.compile(spec)(q, k, v, return_lse=True, **named)
    results = check_attention(out, lse, q, k, v, causal=spec.causal, mask=spec.mask, score_mod=spec.score_mod,
                              tensors=named)
    assert all(r.ok for r in results), results
