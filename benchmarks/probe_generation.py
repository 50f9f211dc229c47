"""Where a generation step's time goes (issue 13): host microseconds per attention call at generation's
shapes, GPU microseconds per call, and whole greedy generations interleaved, transformers' SDPA attention
against flashgen's routes.

The call: one query per row over a KV cache, B=4, 16 query / 4 KV heads, hd128, bf16, the cache a
(B, H_kv, S, D) tensor as transformers' DynamicCache holds it. Providers:
- ``sdpa``: transformers' ``sdpa_attention_forward`` (what a model with attn_implementation="sdpa" runs);
- ``tf_decode_route``: flashgen's transformers attention with ``decode_calls`` on (DecodeLauncher.read);
- ``tf_prefill_route``: the same with ``decode_calls`` off (through flashgen.attention);
- ``attention``: ``flashgen.attention(q, k, v, causal=True, layout="bshd")`` on bshd views of the cache.
Host time: each length is called 8 times (a model's 8 layers), a new length every 8 calls, no sync in the
loop (the kernels take microseconds: the loop is host-bound), least of 3 passes. GPU time: torch.profiler's
kernel time per call at 256 and 4096 keys. Generation: a random Llama (bench_transformers' model: 8 layers,
hidden 2048) generating 128 tokens after a 128- and a 2048-token prompt, the providers interleaved, their
order reversed every other round, median of --rounds.

    PYTHONPATH=. python3 benchmarks/probe_generation.py [--rounds 6] [--no-generate] [--no-gpu-time] [--tag -x]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import flashgen  # before bench_transformers, which puts the repository's root first on sys.path
from flashgen.bench import environment, file_tag, gpu_tag
from flashgen.integrations import transformers as fg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_transformers  # noqa: E402

RANGES = ((129, 257), (1024, 1152), (4000, 4128))
LAYERS = 8


def providers(device):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = type("Layer", (), {"is_causal": True, "num_key_value_groups": 4})()
    q = torch.randn(4, 16, 1, 128, dtype=torch.bfloat16, device=device)
    qb = q.transpose(1, 2)

    def route(decode):
        def call(cache):
            fg.decode_calls, default = decode, fg.decode_calls
            try:
                return fg.attention_forward(layer, q, cache, cache, None, scaling=128 ** -0.5)[0]
            finally:
                fg.decode_calls = default
        return call

    def attention(cache):
        cache = cache.transpose(1, 2)
        return flashgen.attention(qb, cache, cache, causal=True, layout="bshd")

    return {"sdpa": lambda cache: sdpa_attention_forward(layer, q, cache, cache, None, scaling=128 ** -0.5)[0],
            "tf_decode_route": route(True), "tf_prefill_route": route(False), "attention": attention}


def with_ratios(row, names, unit):
    """row with ratio_vs_sdpa_<name> (SDPA's time / the provider's) for every provider but SDPA, printed."""
    for name in names:
        if name != "sdpa":
            row[f"ratio_vs_sdpa_{name}"] = round(row[f"sdpa_{unit}"] / row[f"{name}_{unit}"], 3)
    print(json.dumps(row), flush=True)
    return row


def host_rows(calls, device):
    store = torch.randn(4 * 4 * (RANGES[-1][1] + 1) * 128, dtype=torch.bfloat16, device=device)
    cache = lambda n: store[:4 * 4 * n * 128].view(4, 4, n, 128)  # noqa: E731
    reference = calls["sdpa"](cache(4097)).float()
    rows = []
    for lo, hi in RANGES:
        row = {"case": f"one query, B=4, 16/4 heads, hd128, bf16, caches of {lo}-{hi - 1} keys, {LAYERS} calls a length",
               "mode": "host_us_per_call"}
        for name, call in calls.items():
            for n in range(lo - 20, lo):
                call(cache(n))
            torch.cuda.synchronize()
            passes = []
            for _ in range(3):
                start = time.perf_counter()
                for n in range(lo, hi):
                    c = cache(n)
                    for _ in range(LAYERS):
                        call(c)
                passes.append((time.perf_counter() - start) / ((hi - lo) * LAYERS) * 1e6)
                torch.cuda.synchronize()
            row[f"{name}_us"] = round(min(passes), 1)
        rows.append(with_ratios(row, calls, "us"))
    for name, call in calls.items():  # never time a wrong answer
        err = float((call(cache(4097)).float() - reference).abs().max())
        assert err < 0.05, f"{name}: max |out - sdpa's| {err} at 4097 keys"
    return rows


def gpu_rows(calls, device):
    rows = []
    for n in (256, 4096):
        c = torch.randn(4, 4, n, 128, dtype=torch.bfloat16, device=device)
        row = {"case": f"one query, B=4, 16/4 heads, hd128, bf16, {n} keys", "mode": "gpu_us_per_call"}
        for name, call in calls.items():
            for _ in range(5):
                call(c)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    call(c)
                torch.cuda.synchronize()
            row[f"{name}_us"] = round(sum(e.device_time_total for e in prof.key_averages()) / 50, 2)
        rows.append(with_ratios(row, calls, "us"))
    return rows


def generate_rows(rounds, device):
    import transformers

    name = fg.register()
    args = bench_transformers.parse_args([])
    args.device = device
    model = bench_transformers.build_model(args, torch, transformers).eval()
    gen = torch.Generator().manual_seed(1)
    impls = {"sdpa": ("sdpa", False), "tf_decode_route": (name, True), "tf_prefill_route": (name, False)}

    def run(impl, decode, prompt):
        model.set_attn_implementation(impl)
        fg.decode_calls, default = decode, fg.decode_calls
        try:
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=128, min_new_tokens=128, do_sample=False)
            torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1e3
        finally:
            fg.decode_calls = default

    rows = []
    for length in (128, 2048):
        prompt = torch.randint(0, args.vocab, (4, length), generator=gen).to(device)
        for impl, decode in impls.values():
            run(impl, decode, prompt)
        times = {label: [] for label in impls}
        for r in range(rounds):
            for label in (list(impls) if r % 2 == 0 else list(impls)[::-1]):
                times[label].append(run(*impls[label], prompt))
        row = {"case": f"llama-8L-h2048-16h4kv-bf16, batch 4, prompt {length} + 128 greedy tokens", "mode": "generate_ms"}
        row.update({f"{label}_ms": round(statistics.median(t), 1) for label, t in times.items()})
        row.update({f"{label}_ms_rounds": [round(x, 1) for x in t] for label, t in times.items()})
        rows.append(with_ratios(row, impls, "ms"))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6, help="interleaved generations per provider and prompt")
    p.add_argument("--no-generate", action="store_true")
    p.add_argument("--no-gpu-time", action="store_true")
    p.add_argument("--tag", default="", type=file_tag)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    env = environment()
    calls = providers("cuda")
    with torch.no_grad():
        rows = host_rows(calls, "cuda") + ([] if args.no_gpu_time else gpu_rows(calls, "cuda"))
    if not args.no_generate:
        rows += generate_rows(args.rounds, "cuda")
    stem = f"{datetime.date.today().isoformat()}-{gpu_tag(env)}-call-path-generation{args.tag}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out / stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
