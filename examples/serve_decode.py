"""A serving loop on flashgen's KV cache: greedy decoding of a transformers Llama, checked
token for token against transformers' own generate().

The model comes from a config with random weights (no download). Its layers' weights are used
as they are; only attention is flashgen's:
- prefill: each prompt's causal attention through flashgen.attention (the prefill kernels),
  its keys and values written into the cache;
- decode: one token per sequence per step through flashgen.compat.flash_attn_with_kvcache,
  which appends the new key and value into the cache in place at cache_seqlens and attends over
  the cache (the decode kernels: split-KV, the query heads of a KV group packed into one tile).
The batch's prompts have different lengths: each sequence has its own cache_seqlens, no padding.
The cache is contiguous (batch, capacity, kv heads, dim), or paged: pages of page_size keys
from one pool, handed out in shuffled order through a block table, as an allocator would.

    python3 examples/serve_decode.py                               # on a GPU (bf16)
    TRITON_INTERPRET=1 python3 examples/serve_decode.py --tiny     # on the CPU (fp32)

In bf16 two implementations may round a near tie between the two likeliest tokens
differently, after which the sequences differ for good: a mismatch is reported with
transformers' own margin between its two best logits at that step.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import flashgen
from flashgen.compat import flash_attn_with_kvcache

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
SMALL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=4, head_dim=64)


class KVCache:
    """Every layer's keys and values: contiguous (batch, capacity, kv heads, dim), or with
    page_size paged (pages, page_size, kv heads, dim) with a block table (batch, pages per
    sequence) into a shuffled pool. seqlens: the keys each sequence holds."""

    def __init__(self, layers, batch, capacity, kv_heads, head_dim, *, dtype, device, page_size=None, seed=0):
        self.page_size = page_size
        if page_size:
            per_seq = -(-capacity // page_size)
            pool = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(seed))
            self.block_table = pool.view(batch, per_seq).to(device=device, dtype=torch.int32)
            shape = (batch * per_seq, page_size, kv_heads, head_dim)
        else:
            self.block_table = None
            shape = (batch, capacity, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)

    def write(self, layer, b, k, v):
        """Keys and values (T, kv heads, dim) of sequence b at its positions 0..T-1."""
        pos = torch.arange(k.shape[0], device=k.device)
        if self.page_size:
            where = (self.block_table[b].long()[pos // self.page_size], pos % self.page_size)
        else:
            where = (b, pos)
        self.k[layer][where] = k
        self.v[layer][where] = v


def _layer(layer, h, cos, sin, attend):
    """One Llama decoder layer with attend(q, k, v) -> attention output (batch, T, heads, dim)."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    shape = (*x.shape[:2], -1, attn.head_dim)
    q, k = apply_rotary_pos_emb(attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), cos, sin, unsqueeze_dim=2)
    o = attend(q, k, attn.v_proj(x).view(shape))
    h = h + attn.o_proj(o.reshape(*x.shape[:2], -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


@torch.no_grad()
def generate(model, prompts, new_tokens, *, page_size=None):
    """Greedy decoding of each prompt (a 1-d tensor of token ids) for new_tokens tokens with
    flashgen's prefill and decode over a KV cache; returns (batch, new_tokens) token ids."""
    config, inner = model.config, model.model
    device, dtype = inner.embed_tokens.weight.device, inner.embed_tokens.weight.dtype
    batch = len(prompts)
    cache = KVCache(config.num_hidden_layers, batch, max(len(p) for p in prompts) + new_tokens,
                    config.num_key_value_heads, config.head_dim, dtype=dtype, device=device, page_size=page_size)
    last = []
    for b, prompt in enumerate(prompts):  # prefill, one prompt at a time
        h = inner.embed_tokens(prompt[None])
        cos, sin = inner.rotary_emb(h, torch.arange(len(prompt), device=device)[None])
        for i, layer in enumerate(inner.layers):
            def prefill(q, k, v, i=i):
                cache.write(i, b, k[0], v[0])
                return flashgen.attention(q, k, v, causal=True, layout="bshd")
            h = _layer(layer, h, cos, sin, prefill)
        last.append(model.lm_head(inner.norm(h[:, -1])))
        cache.seqlens[b] = len(prompt)
    tokens = [torch.cat(last).argmax(-1)]
    for _ in range(new_tokens - 1):  # decode: the whole batch, one token per sequence per step
        h = inner.embed_tokens(tokens[-1][:, None])
        cos, sin = inner.rotary_emb(h, cache.seqlens.long()[:, None])
        for i, layer in enumerate(inner.layers):
            def decode(q, k, v, i=i):
                return flash_attn_with_kvcache(q, cache.k[i], cache.v[i], k, v, cache_seqlens=cache.seqlens,
                                               block_table=cache.block_table, causal=True)
            h = _layer(layer, h, cos, sin, decode)
        cache.seqlens += 1
        tokens.append(model.lm_head(inner.norm(h[:, -1])).argmax(-1))
    return torch.stack(tokens, dim=1)


@torch.no_grad()
def reference(model, prompts, new_tokens):
    """transformers' own greedy generate(), one prompt at a time: (tokens, margins), margins the
    gap between its two best logits at each step."""
    tokens, margins = [], []
    for prompt in prompts:
        out = model.generate(prompt[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        tokens.append(out.sequences[0, len(prompt):])
        top2 = torch.stack(out.scores)[:, 0].float().topk(2, dim=-1).values
        margins.append(top2[:, 0] - top2[:, 1])
    return torch.stack(tokens), torch.stack(margins)


def build(tiny: bool, device, dtype, seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**(TINY if tiny else SMALL), attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def run(*, tiny=False, new_tokens=16, page_sizes=(None, 16), lengths=(17, 40, 5), device=None, dtype=None, seed=0):
    """Generate with flashgen (each cache kind) and with transformers; returns
    {cache kind: (flashgen tokens, transformers tokens, transformers margins)}."""
    cpu = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not torch.cuda.is_available()
    device = device or ("cpu" if cpu else "cuda")
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    model = build(tiny, device, dtype, seed)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).to(device) for n in lengths]
    expected, margins = reference(model, prompts, new_tokens)
    return {("paged-%d" % p if p else "contiguous"): (generate(model, prompts, new_tokens, page_size=p), expected,
                                                     margins) for p in page_sizes}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model (for the CPU interpreter)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--page-size", type=int, action="append", help="paged cache page sizes (default 16)")
    args = p.parse_args(argv)
    results = run(tiny=args.tiny, new_tokens=args.new_tokens, page_sizes=(None, *(args.page_size or [16])),
                  lengths=(5, 9, 3) if args.tiny else (17, 40, 5))
    ok = True
    for kind, (tokens, expected, margins) in results.items():
        for b in range(len(tokens)):
            same = tokens[b] == expected[b]
            if bool(same.all()):
                print(f"{kind:>12} sequence {b}: {tokens[b].tolist()} (= transformers)")
                continue
            ok = False
            step = int((~same).nonzero()[0])
            print(f"{kind:>12} sequence {b}: differs from transformers at step {step} (transformers' top-2 "
                  f"margin there: {float(margins[b, step]):.3g})\n    flashgen     {tokens[b].tolist()}\n"
                  f"    transformers {expected[b].tolist()}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
