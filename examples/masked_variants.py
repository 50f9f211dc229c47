"""Masked and modified attention from Python: patterns, expressions, functions, and the
flash-attn drop-in. Runs on a GPU, or on the CPU with TRITON_INTERPRET=1 (small shapes).

    python3 examples/masked_variants.py
"""

import os

import torch

import flashgen
from flashgen.compat import flash_attn_func

gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float16)
b, s, h, d = (4, 4096, 16, 128) if gpu else (1, 64, 2, 32)
q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype) for _ in range(3))

# 1. a built-in pattern with its parameters, by keyword
out = flashgen.attention(q, k, v, layout="bshd", mask={"sliding_window": {"left": 256, "right": 0}})

# 2. a custom expression; named tensors are passed by keyword
ids = (torch.arange(s, device=device) * 4 // s).to(torch.int32)
out = flashgen.attention(q, k, v, layout="bshd", mask="(doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)", doc=ids)


# 3. a Python function (FlexAttention's mask_mod signature), combined with a pattern
def dilated(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx) % 4 == 0


mask = flashgen.mask(dilated) & flashgen.mask(causal={})
out = flashgen.attention(q, k, v, layout="bshd", mask=mask, score_mod={"softcap": 30.0})

# 4. flash-attn's signature and semantics
out = flash_attn_func(q, k, v, causal=True, window_size=(256, 0), softcap=30.0)

# 5. the generated Triton source of any variant
spec = flashgen.AttentionSpec(head_dim=d, num_heads=h, dtype="bf16", mask=mask)
print(flashgen.compile(spec).source()[:400], "...")
print("ok:", tuple(out.shape))
