"""Host time of one decode-shaped transformers attention call on a GPU: transformers' sdpa_attention_forward against
flashgen.integrations.transformers.attention_forward (decode route), alternated, then the pieces of flashgen's call
(launch_read, RawLaunch, the C launcher) and each kernel's device time. Session 62's measurement (results
2026-12-03-h200-call-path-decode-host-s62.*), printed only.

    PYTHONPATH=. python3 benchmarks/decode_call_host.py
"""
import itertools
import statistics
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from flashgen.integrations import transformers as fg_tf
from flashgen.kvcache import compat_launcher
from flashgen.runtime import launch as L
D = 128
dev = "cuda"
query = torch.randn(4, 16, 1, D, dtype=torch.bfloat16, device=dev)
caches = [torch.randn(4, 4, s, D, dtype=torch.bfloat16, device=dev) for s in range(129, 257)]
class Layer(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 4
layer = Layer()
it = itertools.cycle(caches)
def T(name, f, n=2000):
    # host time: n calls timed up to their return, the sync after (so not the device's time)
    for _ in range(200): f()
    torch.cuda.synchronize()
    res = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n): f()
        host = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        res.append(host)
    print(f"{name:48s} host {min(res):7.2f} us (median {statistics.median(res):.2f})", flush=True)
def gpu(name, f, n=500):
    f(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n): f()
    b.record(); torch.cuda.synchronize()
    print(f"{name:48s} device+host {a.elapsed_time(b) / n * 1e3:7.2f} us/call", flush=True)
def sdpa():
    c = next(it)
    with torch.no_grad():
        sdpa_attention_forward(layer, query, c, c, None, scaling=D ** -0.5)
def fg():
    c = next(it)
    with torch.no_grad():
        fg_tf.attention_forward(layer, query, c, c, None, scaling=D ** -0.5)
# the two paths' largest difference, printed before they are timed
with torch.no_grad():
    c = caches[50]
    a = sdpa_attention_forward(layer, query, c, c, None, scaling=D ** -0.5)[0]
    b = fg_tf.attention_forward(layer, query, c, c, None, scaling=D ** -0.5)[0]
    print("max diff", (a.float() - b.float()).abs().max().item(), a.shape, b.shape)
for r in range(2):
    T("transformers sdpa_attention_forward", sdpa)
    T("flashgen attention_forward (decode route)", fg)
launcher = compat_launcher(query, caches[0], caches[0], True, None, None, None, D ** -0.5, layout="bhsd")
def read():
    c = next(it)
    launcher.read(query, c, c, D ** -0.5, layout="bhsd")
T("launcher.read", read)
key = launcher.read_key(query, caches[0], caches[0], D ** -0.5, False, 2)
call = launcher.length_free(launcher.reads[key], 200)
print("plan", {k: v for k, v in call.plan.items() if not hasattr(v, "__len__") or len(str(v)) < 60})
def lr():
    c = next(it)
    launcher.launch_read(call, query, c, c, 2)
T("launch_read", lr)
T("torch.empty_like(query) ", lambda: torch.empty_like(query))
T("call.new_out", call.new_out)
T("launch_context", L.launch_context)
captured = []
orig = L.BoundLaunch.run
def cap(self, context, args):
    captured.append((self, context, args))
    return orig(self, context, args)
L.BoundLaunch.run = cap
try:
    lr()
finally:
    L.BoundLaunch.run = orig
bl, context, args = captured[0]
print("args", len(args), "raw", bl.raw, "tail", len(bl.tail))
T("BoundLaunch.run (same args)", lambda: bl.run(context, args))
if bl.raw:
    T("RawLaunch (same args)", lambda: bl.raw(context[1], args, bl.tail))
    addressed = bl.raw.addressed(args)
    T("RawLaunch.addressed", lambda: bl.raw.addressed(args))
    raw = bl.raw
    T("C launcher alone", lambda: raw.launch(*raw.grid, context[1], *raw.middle, *addressed, *bl.tail))
T("torch.ones(1) add (a trivial op)", lambda: query.add_(0))
gpu("sdpa", sdpa); gpu("flashgen", fg)
def sdpa_k():
    c = caches[100]
    torch.nn.functional.scaled_dot_product_attention(query, c, c, scale=D**-0.5, enable_gqa=True)
def fg_k():
    c = caches[100]
    launcher.launch_read(call, query, c, c, 2)
# each kernel's device time (torch's profiler), at one cache length
for name, f in (("sdpa kernel S=229", sdpa_k), ("flashgen kernel S=229", fg_k)):
    f(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(50): f()
        torch.cuda.synchronize()
    ev = [e for e in p.key_averages()]
    for e in ev:
        print(f"  {name}: {e.key[:70]} n={e.count} dev_avg={e.device_time_total / max(e.count,1):.2f} us")
