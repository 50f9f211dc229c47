"""A padded batch's training step through the transformers integration (session 22), on the GPU.

Issue 13's Llama (8 layers, hidden 2048, 16/4 heads, bf16, random weights) on a left-padded batch of
4 rows of 2048 tokens (2048, 1800, 1500 and 1024 real ones), labels masked on the padding: ms per
training step (forward and backward, wall clock over 8 steps, synchronized at both ends), rounds
alternating the order, for flashgen's integration as it is (``fg_attention``: the mask hook packs the
padding mask once per forward, every layer unpads with that), as it was (``fg_before``: each layer
packs, a nonzero and a max, two waits for the GPU per layer; the same attention under a mask hook
that hands the layers a copy of the mask) and transformers' SDPA:

    PYTHONPATH=. python3 benchmarks/probe_padded_training.py [--rounds 3] [--out benchmarks/results]
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--dry" in sys.argv:  # before Triton decorates flashgen's kernels
    os.environ["TRITON_INTERPRET"] = "1"

import transformers  # noqa: E402

from flashgen.integrations import transformers as integration  # noqa: E402
from probes import alternating, figures, run_probe, step_wall_ms, table_head  # noqa: E402

MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=4096)
ROWS, SEQLEN, STEPS, DTYPE, DEVICE = (2048, 1800, 1500, 1024), 2048, 8, torch.bfloat16, "cuda"
IMPLS = ("fg_attention", "fg_before", "sdpa")


def dry_run() -> None:
    """Shake the script out on the CPU (Triton's interpreter, a 2-layer model of hidden 64, fp32,
    rows of 16 tokens); the figures mean nothing."""
    global ROWS, SEQLEN, STEPS, DTYPE, DEVICE
    MODEL.update(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    ROWS, SEQLEN, STEPS, DTYPE, DEVICE = (16, 12, 9, 5), 16, 1, torch.float32, "cpu"


def register() -> None:
    integration.register()
    transformers.AttentionInterface.register("fg_before", integration.attention_forward)

    def copied_mask(*args, **kwargs):  # the hook's mask as a fresh view: no packing rides with it
        mask = integration.padding_mask(*args, **kwargs)
        return mask if mask is None else mask[:, :]

    transformers.masking_utils.AttentionMaskInterface.register("fg_before", copied_mask)


def run_case(case, args) -> dict:
    register()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).to(DEVICE, DTYPE).train()
    batch = len(ROWS)
    ids = torch.randint(0, MODEL["vocab_size"], (batch, SEQLEN), device=DEVICE)
    mask = torch.ones(batch, SEQLEN, dtype=torch.long, device=DEVICE)
    for row, n in enumerate(ROWS):
        mask[row, :SEQLEN - n] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    labels = ids.masked_fill(mask == 0, -100)

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=mask, position_ids=positions, labels=labels).loss.backward()

    def measure(impl):
        model.set_attn_implementation(impl)
        return round(step_wall_ms(step, STEPS), 3)

    times = alternating(IMPLS, args.rounds, measure)
    now = statistics.median(times["fg_attention"])
    return {"case": case, "mode": "train_step", "rows": list(ROWS), "seqlen": SEQLEN,
            **{f"{impl}_ms": t for impl, t in times.items()},
            "ratio_vs_before": round(statistics.median(times["fg_before"]) / now, 3),
            "ratio_vs_sdpa": round(statistics.median(times["sdpa"]) / now, 3)}


def markdown(rows, env) -> str:
    lines = table_head("Padded training step, transformers integration", env,
                       f"Llama {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, "
                       f"{MODEL['num_attention_heads']}/{MODEL['num_key_value_heads']} heads; ms per step (each "
                       "round's); ratios: median / flashgen's (now) median.",
                       ["case", "flashgen ms (now)", "flashgen ms (before)", "SDPA ms", "ratio vs before",
                        "ratio vs SDPA"])
    for r in rows:
        lines.append(f"| {r['case']} | {figures(r['fg_attention_ms'])} | {figures(r['fg_before_ms'])} | "
                     f"{figures(r['sdpa_ms'])} | "
                     f"{r['ratio_vs_before']} | {r['ratio_vs_sdpa']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_probe(__doc__.splitlines()[0], "padded-training", ["llama, 4 left-padded rows"], run_case, markdown,
              dry_run)
