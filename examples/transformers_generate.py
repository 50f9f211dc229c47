"""A transformers model on flashgen attention: one register() call, then attn_implementation.

Builds a small random-init Llama (or Gemma 2 / gpt-oss, whose sliding windows, softcapping and
sinks flashgen also runs), checks that its logits on a left-padded batch agree with the model's
own attention, then greedily generates from that batch with both and prints the tokens. Pass
--model for a checkpoint from the Hub instead (needs network access and the weights).

    python3 examples/transformers_generate.py                           # on a GPU (bf16)
    TRITON_INTERPRET=1 python3 examples/transformers_generate.py --tiny # on the CPU (fp32, slow)
"""

import argparse
import os

import torch
import transformers

from flashgen.integrations.transformers import register

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
SMALL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=4, head_dim=64)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}, "sdpa"),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(sliding_window=8, attn_logit_softcapping=50.0), "eager"),
    "gpt-oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2), "eager"),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    p.add_argument("--model", help="a Hub id or local path (instead of a random-init model)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (for the CPU interpreter)")
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args()
    cpu = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not torch.cuda.is_available()
    device, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)

    name = register()  # "fg_attention": any transformers model can now use it
    config_cls, model_cls, extra, reference = FAMILIES[args.family]
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=name)
    else:
        torch.manual_seed(0)
        model = model_cls(config_cls(**(TINY if args.tiny else SMALL), **extra))
    model = model.to(device=device, dtype=dtype).eval()
    if args.family == "gpt-oss" and cpu:
        model.set_experts_implementation("eager")  # no grouped matmul kernel on the CPU

    # Left padding: row 1 has 5 pad tokens. flashgen packs the real tokens (varlen), no dense mask.
    ids = torch.randint(0, model.config.vocab_size, (2, 24), device=device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    outputs = {}
    for impl in (reference, name):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                                pad_token_id=0)[:, ids.shape[1]:]
        outputs[impl] = (logits[mask.bool()].float(), tokens)
    diff = (outputs[name][0] - outputs[reference][0]).abs().max().item()
    print(f"{args.family}: max |logits difference| vs transformers' {reference}: {diff:.3g}")
    for impl, (_, tokens) in outputs.items():
        print(f"{impl:>12}: {tokens.tolist()}")


if __name__ == "__main__":
    main()
