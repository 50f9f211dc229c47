"""A small GPT trained on packed documents with a document mask, on flashgen attention.

Documents of different lengths are packed into fixed-length rows; each token attends
causally within its own document only (block-diagonal causal), so no padding and no
cross-document leakage. The mask is a spec field; the per-token document ids are passed
at call time and the kernel finds each query block's key range from them.

    python3 examples/gpt_packed_documents.py            # on a GPU (bf16)
    TRITON_INTERPRET=1 python3 examples/gpt_packed_documents.py --steps 3   # on the CPU (slow, tiny)
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import flashgen


class Block(nn.Module):
    def __init__(self, dim, heads, attention):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.attention = attention

    def forward(self, x, document_ids):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        y = self.attention(q, k, v, layout="bshd", document_ids=document_ids)  # (b, s, heads, head_dim)
        x = x + self.proj(y.reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab, dim, heads, layers, dtype):
        super().__init__()
        spec = flashgen.AttentionSpec(name="gpt-docs", dtype=dtype, head_dim=dim // heads, num_heads=heads,
                                      mask={"document": {"ids": "document_ids", "causal": True}}, backward=True)
        attention = flashgen.load(spec)  # tuned configs if this GPU has them, else the default (one warning)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attention) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, document_ids):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, document_ids)
        return self.head(x)


def packed_batch(batch, seqlen, vocab, device, generator):
    """Random documents packed into rows: tokens and nondecreasing per-token document ids."""
    tokens = torch.randint(0, vocab, (batch, seqlen), generator=generator)
    ids = torch.empty(batch, seqlen, dtype=torch.int32)
    for row in range(batch):
        lengths, total = [], 0
        while total < seqlen:
            n = min(int(torch.randint(seqlen // 16, seqlen // 2, (1,), generator=generator)), seqlen - total)
            lengths.append(n)
            total += n
        ids[row] = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
    return tokens.to(device), ids.to(device)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    batch, seqlen, vocab, dim, heads, layers = (8, 2048, 4096, 512, 8, 4) if gpu else (2, 64, 64, 32, 2, 1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = GPT(vocab, dim, heads, layers, "bf16" if gpu else "fp32").to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for step in range(args.steps):
        tokens, ids = packed_batch(batch, seqlen + 1, vocab, device, gen)
        logits = model(tokens[:, :-1], ids[:, :-1].contiguous())
        # never predict across a document boundary
        target = tokens[:, 1:].masked_fill(ids[:, 1:] != ids[:, :-1], -100)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), target.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
