"""Why the tiny gpt-oss's bf16 logits sit far from its float32 ones under flashgen (0.0962 on an H200,
the eager bf16 path 0.0033), on the CPU: the model's eager attention replaced by FlashAttention's
numerics written in PyTorch (scores and the softmax in float32, the sink logit in the max and the sum,
P = exp(s - m) rounded to bf16 before P V, float32 accumulation, then / l), and by the same with P
kept in float32. Prints each bf16 run's max |logits - float32 eager logits| over the test suite's
tokens (tests/test_integration_transformers.py, seed 8), and how many tokens its MoE routers send to
other experts than the float32 run's. CPU only:

    PYTHONPATH=. python3 benchmarks/probe_gpt_oss_bf16.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_integration_transformers as T  # noqa: E402 (the suite's tiny models)
import transformers.models.gpt_oss.modeling_gpt_oss as gpt_oss  # noqa: E402

EAGER = gpt_oss.eager_attention_forward
MODE = {"p": None}  # None: transformers' eager; "float32": P in float32; "bf16": P rounded to the inputs' dtype


def flash_numerics(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    if MODE["p"] is None:
        return EAGER(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    group = query.shape[1] // key.shape[1]
    k, v = (t.repeat_interleave(group, 1).float() for t in (key, value))
    s = query.float() @ k.transpose(-1, -2) * scaling
    if attention_mask is not None:
        s = s + attention_mask[:, :, :, : k.shape[-2]].float()
    sinks = module.sinks.float().reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    scores = torch.cat([s, sinks], -1)
    p = torch.exp(scores - scores.max(-1, keepdim=True).values)
    total = p.sum(-1, keepdim=True)
    p = p[..., :-1]
    if MODE["p"] == "bf16":
        p = p.to(query.dtype).float()
    return ((p @ v) / total).to(query.dtype).transpose(1, 2).contiguous(), None


def main():
    gpt_oss.eager_attention_forward = flash_numerics
    model, gen = T._model("gpt_oss"), torch.Generator().manual_seed(8)
    model.to(torch.bfloat16)  # the bf16 weights; float32 runs use them exactly
    ids = torch.randint(0, T.VOCAB, (2, 23), generator=gen)
    routes = []  # per router call: each token's chosen experts, sorted
    for layer in model.model.layers:
        layer.mlp.router.register_forward_hook(lambda mod, inp, out: routes.append(out[-1].sort(-1).values))
    with torch.no_grad():
        ref = T._logits(model, "eager", torch.float32, ids).float()
        ref_routes = list(routes)
        for mode in (None, "float32", "bf16"):
            MODE["p"], routes[:] = mode, []
            out = T._logits(model, "eager", torch.bfloat16, ids).float()
            moved = sum(int((a != b).any(-1).sum()) for a, b in zip(routes, ref_routes))
            print(f"P {mode or 'eager'}: max |bf16 logits - float32 logits| = {(out - ref).abs().max().item():.4g}, "
                  f"tokens routed to other experts: {moved}")


if __name__ == "__main__":
    main()
