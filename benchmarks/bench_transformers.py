"""A transformers Llama as a model calls attention: flashgen beside transformers' SDPA, same model, same process.

Random-init Llama (default: 8 layers, hidden 2048, 16 heads / 4 KV heads, head dim 128,
intermediate 5632, vocab 32000, bf16), run with ``attn_implementation`` = flashgen's
(``flashgen.integrations.transformers.register()``) and ``"sdpa"`` in turn:

* ``train_step``: forward + backward + AdamW step on batch 4 x 2048 tokens (median ms per step);
* ``prefill``: a no-grad forward of the same batch, after checking both paths' logits agree;
* ``generate``: greedy generation of 128 new tokens after a 128-token prompt, batch 4 (dynamic
  KV cache, exactly 128 tokens each: no EOS), whole ``generate`` call. A generation step is host
  time, which drifts over a run by more than the two paths differ, so the two run in alternating
  rounds (sdpa then flashgen, then flashgen then sdpa, ...; ``--generate-runs`` rounds): the
  medians of each, and each round's ratio (``ratio_per_round``, its median beside); then the
  same with flashgen's decode-shaped calls through flashgen.attention instead of the integration's
  direct decode route (``generate (through flashgen.attention)``,
  ``flashgen.integrations.transformers.decode_calls = False``);
* ``generate (static cache)``: the same with ``cache_implementation="static"``, whose steps after the
  prompt transformers compiles on a GPU (inductor with CUDA graphs, its default ``CompileConfig``);
* ``compile_train_step``: ``torch.compile(model, fullgraph=True)`` (inductor on the GPU,
  aot_eager on the CPU) then the training step, compiled both ways; a failure to compile is
  recorded with its error.

Each part runs in its own try/except: a failure is stored in its row (``error``) and the rest
still runs. ``ratio_vs_sdpa`` is sdpa_ms / flashgen_ms, so above 1 means flashgen is faster.
Writes ``<out>/<date>-<gpu>-call-path-transformers.json`` (rows: case, mode, flashgen_ms,
sdpa_ms, ratio_vs_sdpa, ...; with the environment and config) and a markdown table beside it.

    PYTHONPATH=. python3 benchmarks/bench_transformers.py                      # the H100 run
    PYTHONPATH=. python3 benchmarks/bench_transformers.py --tiny --device cpu  # a CPU check of the script
    PYTHONPATH=. python3 benchmarks/bench_transformers.py --model gemma3 --heads 8 --kv-heads 4 --seqlen 4096 \
        --batch 2 --intermediate 8192    # Gemma 3's attention: head dim 256, 1024-key windows
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_call_path's kernel_profile

FULL = dict(layers=8, hidden=2048, intermediate=5632, heads=16, kv_heads=4, vocab=32000, batch=4, seqlen=2048,
            prompt=128, new_tokens=128, dtype="bf16", warmup=3, steps=10, generate_runs=8)
TINY = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=128, batch=2, seqlen=24,
            prompt=8, new_tokens=4, dtype="fp32", warmup=1, steps=2, generate_runs=2)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_args(argv=None):
    from flashgen.bench import file_tag

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model and batch (checks the script, not speed)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu runs flashgen's kernels through Triton's interpreter")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="folder for the JSON and table")
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["train_step", "prefill", "generate", "generate_static", "compile_train_step"],
                   help="modes to leave out")
    p.add_argument("--tag", default="", type=file_tag, help="file name suffix: v2 (or -v2) writes ...-v2")
    p.add_argument("--model", default="llama", choices=["llama", "gemma3"],
                   help="gemma3: Gemma 3's text model (head dim 256 by default, 5 sliding-window layers to 1 global)")
    p.add_argument("--head-dim", type=int, default=None, help="gemma3: the head dim (default 256)")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="gemma3: its sliding layers' window in keys (default 1024, Gemma 3's)")
    p.add_argument("--profile-train", action="store_true",
                   help="also GPU time per training step by kernel (torch.profiler), both implementations")
    for name, value in FULL.items():  # every size is a flag; --tiny changes the defaults
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None)
    args = p.parse_args(argv)
    for name, value in (TINY if args.tiny else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.generate_runs < 1:
        p.error(f"--generate-runs: expected at least 1 round, got {args.generate_runs}")
    if args.dtype not in DTYPES:
        p.error(f"--dtype: expected one of {sorted(DTYPES)}, got {args.dtype!r}")
    if args.model == "llama" and (args.head_dim or args.sliding_window):
        p.error(f"--head-dim and --sliding-window are gemma3's (--model gemma3), got --head-dim {args.head_dim} "
                f"--sliding-window {args.sliding_window} for --model llama")
    return args


def build_model(args, torch, transformers):
    sizes = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                 max_position_embeddings=max(args.seqlen, args.prompt + args.new_tokens), eos_token_id=None,
                 pad_token_id=None, bos_token_id=None)
    if args.model == "gemma3":
        head_dim = args.head_dim or 256
        config, cls = transformers.Gemma3TextConfig(**sizes, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                                                    sliding_window=args.sliding_window or 1024), \
            transformers.Gemma3ForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**sizes), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(args.device):
        model = cls(config)
    return model.to(getattr(torch, DTYPES[args.dtype]))


class Timer:
    """Median milliseconds of fn() over `steps` runs after `warmup`: CUDA events on the GPU, the
    host clock on the CPU (there a 'time' measures Triton's interpreter, not a kernel)."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def __call__(self, fn, warmup, steps):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(steps):
            self.sync()
            start = time.perf_counter()
            if self.cuda:
                begin, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            else:
                fn()
                times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)


def error_text(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines).strip()[:2000]


def run_mode(rows, case, mode, measure, **extra):
    """One row: measure(impl) -> ms for flashgen and sdpa; an exception is stored, not raised."""
    row = {"case": case, "mode": mode, "flashgen_ms": None, "sdpa_ms": None, "ratio_vs_sdpa": None, **extra}
    for impl, key in (("sdpa", "sdpa_ms"), ("flashgen", "flashgen_ms")):
        try:
            row[key] = round(measure(impl), 3)
        except Exception as exc:  # noqa: BLE001 - a benchmark part records its failure and the run goes on
            row.setdefault("error", {})[impl] = error_text(exc)
            print(f"[{mode}/{impl}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    if row["flashgen_ms"] and row["sdpa_ms"]:
        row["ratio_vs_sdpa"] = round(row["sdpa_ms"] / row["flashgen_ms"], 3)
    rows.append(row)
    print(json.dumps(row), flush=True)
    return row


def run_alternating(rows, case, mode, once, rounds, **extra):
    """One row as run_mode's, the two implementations timed in alternating rounds: once(impl) -> ms of one
    run (each run once first, untimed), then `rounds` rounds, sdpa first in even rounds and flashgen first
    in odd ones; the medians of each and every round's ratio. A failure is stored, not raised."""
    row = {"case": case, "mode": mode, "flashgen_ms": None, "sdpa_ms": None, "ratio_vs_sdpa": None, **extra}
    times = {"sdpa": [], "flashgen": []}
    impl = "sdpa"
    try:
        for impl in times:
            once(impl)
        for r in range(rounds):
            for impl in (("sdpa", "flashgen") if r % 2 == 0 else ("flashgen", "sdpa")):
                times[impl].append(once(impl))
    except Exception as exc:  # noqa: BLE001 - a benchmark part records its failure and the run goes on
        row["error"] = {impl: error_text(exc)}  # (the implementation that was running)
        print(f"[{mode}/{impl}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    if rounds > 0 and len(times["flashgen"]) == len(times["sdpa"]) == rounds and min(times["flashgen"]) > 0:
        row["sdpa_ms"], row["flashgen_ms"] = (round(statistics.median(times[i]), 3) for i in ("sdpa", "flashgen"))
        row["ratio_vs_sdpa"] = round(row["sdpa_ms"] / row["flashgen_ms"], 3)
        per_round = [s / f for s, f in zip(times["sdpa"], times["flashgen"])]
        row["ratio_per_round"] = [round(x, 3) for x in per_round]
        row["ratio_per_round_median"] = round(statistics.median(per_round), 3)
    rows.append(row)
    print(json.dumps(row), flush=True)
    return row


def train_profile(torch, model, ids, use, steps=3) -> dict:
    """Where a training step's GPU time goes: us per step by kernel (bench_call_path.kernel_profile: the
    10 largest, attention kernels named as they are), the sum of all kernels and the wall time."""
    from bench_call_path import kernel_profile

    use()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    try:
        times = kernel_profile(step, steps, top=10, width=70)
    finally:
        del opt
        model.zero_grad(set_to_none=True)
    times["kernels_total_us"], times["wall_us"] = times.pop("total"), times.pop("wall")
    return times


def benchmark(args) -> dict:
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        # (main sets it before anything imports Triton.) @triton.jit chose compiled or interpreted when
        # this process imported it: setting it now would leave some kernels compiled, later ones interpreted.
        raise SystemExit("--device cpu: set TRITON_INTERPRET=1 before this process imports triton")
    import torch
    import transformers

    from flashgen.bench import environment
    from flashgen.integrations.transformers import register

    names = {"flashgen": register(), "sdpa": "sdpa"}
    model = build_model(args, torch, transformers)
    timer = Timer(torch, args.device)
    shape = f"hd{args.head_dim or 256}-window{args.sliding_window or 1024}-" if args.model == "gemma3" else ""
    case = (f"{args.model}-{args.layers}L-h{args.hidden}-{args.heads}h{args.kv_heads}kv-{shape}{args.dtype}-"
            f"b{args.batch}x{args.seqlen}")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), generator=gen).to(args.device)
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=gen).to(args.device)
    rows, profiles = [], {}

    def use(impl, train):
        model.set_attn_implementation(names[impl])
        model.train(train)

    if "prefill" not in args.skip:
        logits = {}

        def prefill(impl):
            use(impl, False)
            with torch.no_grad():
                logits[impl] = model(ids[:, :min(args.seqlen, 512)]).logits.float()  # the check first
                return timer(lambda: model(ids), args.warmup, args.steps)

        row = run_mode(rows, case, "prefill", prefill)
        if len(logits) == 2:
            row["max_abs_logit_diff_vs_sdpa"] = float((logits["flashgen"] - logits["sdpa"]).abs().max())
        logits.clear()

    def train_measure(forward):
        def measure(impl):
            use(impl, True)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

            def step():
                forward(ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            try:
                return timer(step, args.warmup, args.steps)
            finally:
                del opt
                model.zero_grad(set_to_none=True)
        return measure

    if "train_step" not in args.skip:
        row = run_mode(rows, case, "train_step", train_measure(model))
        if row["flashgen_ms"]:
            row["flashgen_tokens_per_s"] = round(args.batch * args.seqlen / row["flashgen_ms"] * 1e3)
        if args.profile_train and args.device == "cuda":
            profiles.update({impl: train_profile(torch, model, ids, lambda: use(impl, True)) for impl in names})

    if "generate" not in args.skip:
        tokens = {}

        def generate(impl, **kw):  # one timed run
            use(impl, False)

            def run():
                tokens[impl] = model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                              do_sample=False, **kw)[:, args.prompt:]
            return timer(run, 0, 1)

        row = run_alternating(rows, f"{case}-prompt{args.prompt}+{args.new_tokens}", "generate", generate,
                              args.generate_runs)
        if len(tokens) == 2:  # bf16 roundings may flip a near-tie; report how many tokens agree
            row["same_tokens_fraction"] = float((tokens["flashgen"] == tokens["sdpa"]).float().mean())

        def generate_through_attention(impl):  # the same, flashgen's decode steps through flashgen.attention
            from flashgen.integrations import transformers as integration

            default, integration.decode_calls = integration.decode_calls, False
            try:
                return generate(impl)
            finally:
                integration.decode_calls = default

        run_alternating(rows, f"{case}-prompt{args.prompt}+{args.new_tokens}", "generate (through flashgen.attention)",
                        generate_through_attention, args.generate_runs)

    if "generate_static" not in args.skip:
        # a static KV cache, whose steps after the prompt transformers compiles on a GPU (its default
        # CompileConfig: inductor, CUDA graphs; each implementation's first, untimed run compiles them)
        tokens = {}
        row = run_alternating(rows, f"{case}-prompt{args.prompt}+{args.new_tokens}", "generate (static cache)",
                              lambda impl: generate(impl, cache_implementation="static"), args.generate_runs)
        if len(tokens) == 2:
            row["same_tokens_fraction"] = float((tokens["flashgen"] == tokens["sdpa"]).float().mean())

    if "compile_train_step" not in args.skip:
        backend = "inductor" if args.device == "cuda" else "aot_eager"

        def compiled(impl):
            torch._dynamo.reset()
            return train_measure(torch.compile(model, fullgraph=True, backend=backend))(impl)

        run_mode(rows, case, "compile_train_step", compiled, backend=backend)

    env = environment()
    env["transformers"] = transformers.__version__
    config = {k: getattr(args, k) for k in (*FULL, "model", "head_dim", "sliding_window")}
    return {"environment": env, "config": config, "device": args.device, "rows": rows,
            **({"train_profile": profiles} if profiles else {})}


def gpu_slug(env: dict, device: str) -> str:
    if device == "cpu" or "gpu" not in env:
        return "cpu"
    name = env["gpu"].lower()
    known = re.search(r"\b([abhl]\d{2,3}|mi\d{3}x?|b200|gh200)\b", name)
    return known.group(1) if known else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def markdown(result: dict) -> str:
    env = result["environment"]
    model = {"gemma3": "Gemma 3"}.get(result.get("config", {}).get("model"), "Llama")
    lines = [f"transformers {model}, flashgen vs transformers' SDPA attention | {env.get('gpu', 'cpu')} | "
             f"torch {env['torch']} | triton {env['triton']} | transformers {env['transformers']} | "
             f"flashgen {env['flashgen']}", "",
             "ratio_vs_sdpa = sdpa_ms / flashgen_ms (above 1: flashgen faster)", "",
             "| case | mode | flashgen ms | sdpa ms | ratio vs sdpa | notes |", "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        notes = {k: v for k, v in row.items() if k not in ("case", "mode", "flashgen_ms", "sdpa_ms", "ratio_vs_sdpa")}
        if "error" in notes:
            notes["error"] = {k: v.splitlines()[0][:200] for k, v in notes["error"].items()}
        fmt = lambda x: "-" if x is None else f"{x:g}"  # noqa: E731
        lines.append(f"| {row['case']} | {row['mode']} | {fmt(row['flashgen_ms'])} | {fmt(row['sdpa_ms'])} | "
                     f"{fmt(row['ratio_vs_sdpa'])} | {json.dumps(notes) if notes else ''} |")
    for impl, times in result.get("train_profile", {}).items():
        lines.append(f"\nGPU us per training step by kernel, {impl}: " + "; ".join(f"{k} {v}" for k, v in times.items()))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    device = argparse.ArgumentParser(add_help=False)  # --device alone, read as parse_args reads it
    device.add_argument("--device")
    if device.parse_known_args(argv)[0].device == "cpu" and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before parse_args imports flashgen, and flashgen Triton
    args = parse_args(argv)
    result = benchmark(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today().isoformat()}-{gpu_slug(result['environment'], args.device)}-call-path-transformers"
    if args.tiny:
        stem += "-tiny"
    stem += args.tag
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {args.out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
