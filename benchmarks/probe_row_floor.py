"""Session 53: rows wholly below the score floor count as masked, in _finalize (common/tiles.j2), only in kernels
reading a per-key float tensor (additive masks): its cost on the SDPA-shaped entry with float masks, same process,
interleaved do_bench rounds. Arms: today's templates ("floor") and the same with common/tiles.j2 as of f076d96, before
the rule ("no floor", read with git show). A -2e5 row tells the arms apart (0 under the floor).

    PYTHONPATH=. python3 benchmarks/probe_row_floor.py results.json"""
import json, shutil, statistics, subprocess, sys, tempfile
from pathlib import Path
import torch
import flashgen
from flashgen import api, ops
from flashgen.codegen import render
from triton.testing import do_bench

new_dir = render.template_dir()
old_dir = Path(tempfile.mkdtemp()) / "templates"
shutil.copytree(new_dir, old_dir)
(old_dir / "common/tiles.j2").write_text(subprocess.run(["git", "show", "f076d96:templates/common/tiles.j2"],
                                                        check=True, capture_output=True, text=True).stdout)
orig_dir = render.template_dir


def build(kid, d):
    render.template_dir = lambda: d
    render._environment.cache_clear()
    ops._MODULES.pop(kid, None)
    m = ops.kernel_module(kid)
    render.template_dir = orig_dir
    render._environment.cache_clear()
    return m


def use(arms, arm):
    for kid, mods in arms.items():
        ops._MODULES[kid] = mods[arm]
    api._FAST.clear()
    for kern in api._BOUND.values():
        kern._fast.clear()


dt = torch.bfloat16
rows = []
arms = {}
cases = []
for B, S, shape, fill in ((4, 2048, "LS", None), (1, 4096, "LS", None), (4, 2048, "B1LS causal", "min"),
                          (2, 4096, "B1LS causal", "min")):
    cases.append((B, S, shape, fill))
for B, S, shape, fill in cases:
    H, D = 16, 128
    g = torch.Generator(device="cuda").manual_seed(S + B)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dt, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(B, H, S, D, device="cuda", dtype=dt, generator=g)
    if shape == "LS":
        mask = torch.randn(S, S, device="cuda", dtype=dt, generator=g)
    else:
        keep = torch.ones(S, S, device="cuda", dtype=torch.bool).tril()
        mask = torch.zeros(B, 1, S, S, device="cuda", dtype=dt).masked_fill(~keep, torch.finfo(dt).min)
    before = set(ops._MODULES)
    sdpa = flashgen.scaled_dot_product_attention
    sdpa(q, k, v, attn_mask=mask).sum().backward()
    kids = [kid for kid in ops._MODULES if kid not in before]
    arms.update({kid: {"floor": ops._MODULES[kid], "no floor": build(kid, old_dir)} for kid in kids})
    # the arms differ: a row wholly at -2e5 gives 0 under the floor
    probe = mask.clone()
    probe[..., 0, :] = -2e5
    probe_rows = {}
    for arm in ("floor", "no floor"):
        use(arms, arm)
        probe_rows[arm] = sdpa(q, k, v, attn_mask=probe)[:, :, 0].abs().max().item()
    assert probe_rows["floor"] == 0 and probe_rows["no floor"] > 0, probe_rows
    row = {"case": f"sdpa float mask {shape} {'finfo.min' if fill else 'randn'} B={B} H={H} S={S} hd{D} bf16",
           "kernels": len(arms), "probe_row_max_abs": probe_rows}
    fns = {}
    for arm in ("floor", "no floor"):
        fns[(arm, "fwd")] = lambda arm=arm: sdpa(q, k, v, attn_mask=mask)
        fns[(arm, "fwd+bwd")] = lambda arm=arm: torch.autograd.grad(sdpa(q, k, v, attn_mask=mask), (q, k, v), do)
    t = {key: [] for key in fns}
    for r in range(3):
        for key in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            use(arms, key[0])
            fns[key]()
            t[key].append(do_bench(fns[key], warmup=25, rep=150, return_mode="median"))
    for (arm, mode), xs in t.items():
        row[f"{arm} {mode} ms"] = [round(x, 4) for x in xs]
    for mode in ("fwd", "fwd+bwd"):
        row[f"ratio {mode} (no floor / floor)"] = round(statistics.median(t[("no floor", mode)])
                                                        / statistics.median(t[("floor", mode)]), 3)
    use(arms, "floor")
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump({"environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "triton": __import__("triton").__version__}, "rows": rows}, open(sys.argv[1], "w"), indent=1)
