"""The per-call fast path (issue 13 item 1): call plans (a call's checks once per metadata key,
flashgen/runtime/host.py) and bound launches (Triton's launcher called directly after the first
launch, flashgen/runtime/launch.py).

Four levels: BoundLaunch's own logic against a stand-in kernel (which path each call takes, the
argument order, hooks, devices, the verification mode); planned calls through the interpreter
(bitwise the same as calls planned afresh, new plans when a stride or an alignment changes, bad
calls after good ones still named); the real Triton launch path on the CPU (kernels compiled for
sm90 in a child process: a bound launch hands CompiledKernel.run the same arguments as
JITFunction.run); and the GPU (bound and normal launches bitwise equal, Triton's binder agreeing
with every bound launch)."""

import contextlib
import functools
import inspect
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, KernelConfig, ops
from flashgen.runtime import launch
from flashgen.runtime.launch import BoundLaunch
from flashgen.verify import assert_attention_close, assert_gradients_close

from .helpers import child_pythonpath

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- BoundLaunch
class FakeCompiled:
    """Stands in for a CompiledKernel: .run records the launcher's arguments."""
    packed_metadata, function = "packed", 7

    def __init__(self):
        self.launches = []

    @property
    def run(self):
        return lambda *args: self.launches.append(args)


def fake_kernel_fn(X, n, scale, BLOCK, FLAG=True):  # noqa: N803 (kernel names)
    pass


class FakeKernel:
    """Stands in for a JITFunction: kernel[grid](...) records Triton's path and returns the compiled
    kernel; its binder specializes ints by == 1 and % 16, as Triton's does."""

    def __init__(self):
        self.signature = inspect.signature(fake_kernel_fn)
        self.compiled, self.normal = FakeCompiled(), []
        self.device_caches = {0: (None, None, None, None, self.binder), 1: (None, None, None, None, self.binder)}
        self.__name__ = "fake_kernel_fn"

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.normal.append((grid, args, kwargs))
            return self.compiled
        return launch_

    def binder(self, *args, **kwargs):
        bound = self.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in self.signature.parameters})
        bound.apply_defaults()
        spec = [("i32", a == 1, a % 16 == 0) if isinstance(a, int) else (type(a).__name__,)
                for a in bound.arguments.values()]
        return bound.arguments, spec, kwargs


class FakeDriver:
    device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


@pytest.fixture
def fake_driver(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(launch, "triton_driver", type("Config", (), {"active": driver})())
    return driver


def test_bound_launch_calls_the_compiled_kernel_after_the_first_launch(fake_driver):
    kernel = FakeKernel()
    bound = BoundLaunch(kernel, (3, 2), dict(BLOCK=64, num_warps=4))
    x = torch.empty(4)
    assert bound(x, 32, 0.5) is kernel.compiled and len(kernel.normal) == 1  # Triton's path, then bound
    assert kernel.normal[0] == ((3, 2), (x, 32, 0.5), {"BLOCK": 64, "num_warps": 4})
    bound(x, 32, 0.5)
    assert len(kernel.normal) == 1
    # grid padded to 3, the stream of the current device, no metadata or hooks, then every parameter
    # in signature order: the positional ones, the constexprs, the defaults of those not given
    assert kernel.compiled.launches == [(3, 2, 1, 1000, 7, "packed", None, None, None, x, 32, 0.5, 64, True)]


def test_bound_launch_takes_tritons_path_when_it_must(fake_driver, monkeypatch):
    kernel = FakeKernel()
    bound = BoundLaunch(kernel, (1,), dict(BLOCK=16))
    bound(None, 16, 1.0)
    bound(None, 16, 1.0)
    assert len(kernel.normal) == 1 and len(kernel.compiled.launches) == 1
    # a launch hook is installed: the hooks read metadata only Triton's path builds
    runtime = launch.triton_knobs.runtime
    hook = runtime.launch_enter_hook
    if hasattr(hook, "add"):
        monkeypatch.setattr(hook, "calls", [lambda metadata: None])
    else:  # a plain function slot (older Triton)
        monkeypatch.setattr(runtime, "launch_enter_hook", lambda metadata: None)
    assert launch.launch_hooks_set()
    bound(None, 16, 1.0)
    assert len(kernel.normal) == 2
    monkeypatch.undo()
    monkeypatch.setattr(launch, "triton_driver", type("Config", (), {"active": fake_driver})())
    assert not launch.launch_hooks_set()
    # bound launches turned off
    monkeypatch.setattr(BoundLaunch, "enabled", False)
    bound(None, 16, 1.0)
    assert len(kernel.normal) == 3 and len(kernel.compiled.launches) == 1


def _fake_device_guard(monkeypatch, driver):
    """torch.cuda.device(i) as a context that makes i the fake driver's current device; returns the devices
    made current, in order."""
    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        before, driver.device = driver.device, index
        try:
            yield
        finally:
            driver.device = before
    monkeypatch.setattr(torch.cuda, "device", device)
    return entered


def test_a_launch_runs_on_its_tensors_device_not_the_current_one(fake_driver, monkeypatch):
    # A model spread over GPUs in one process (transformers' device_map="auto") calls its layers on cuda:1 while
    # cuda:0 stays current; Triton launches on the current device, so flashgen launched cuda:1's tensors on cuda:0
    # (and bound the kernel there). Each launch now makes its tensors' device current, as torch's ops do.
    entered = _fake_device_guard(monkeypatch, fake_driver)
    monkeypatch.setattr(launch, "tensors_device", lambda args: 1)  # (CPU tensors here: their device as cuda:1's)
    seen = []  # the current device at each launch by Triton's path

    class Kernel(FakeKernel):
        def __getitem__(self, grid):
            seen.append(fake_driver.device)
            return super().__getitem__(grid)
    kernel = Kernel()
    bound = BoundLaunch(kernel, (2,), dict(BLOCK=16))
    x = torch.empty(4)
    bound(x, 16, 1.0)  # Triton's path, on cuda:1, and bound there
    assert seen == [1] and bound.device == 1 and fake_driver.device == 0
    bound(x, 16, 1.0)  # bound, on cuda:1's current stream
    assert len(kernel.normal) == 1 and kernel.compiled.launches[-1][3] == 1001 and fake_driver.device == 0
    fake_driver.device = 1  # with cuda:1 current: no device change
    bound(x, 16, 1.0)
    assert kernel.compiled.launches[-1][3] == 1001 and entered == [1, 1]
    # Triton's path every time (bound launches off): on cuda:1 too
    fake_driver.device = 0
    monkeypatch.setattr(BoundLaunch, "enabled", False)
    bound(x, 16, 1.0)
    assert seen == [1, 1] and len(kernel.normal) == 2 and fake_driver.device == 0
    # a bound launch whose current device is another: its own device made current (it took Triton's path before)
    monkeypatch.setattr(BoundLaunch, "enabled", True)
    monkeypatch.setattr(launch, "tensors_device", lambda args: 0)
    other = BoundLaunch(FakeKernel(), (1,), dict(BLOCK=16))
    other(x, 16, 1.0)
    fake_driver.device = 1
    other(x, 16, 1.0)
    assert len(other.kernel.normal) == 1 and other.kernel.compiled.launches[-1][3] == 1000 and fake_driver.device == 1


def test_capturing_asks_the_tensors_device_where_the_current_one_captures(monkeypatch):
    # a call on cuda:1's tensors while cuda:0's stream captures a graph runs eagerly on cuda:1: not captured
    current, captures = [0], {0}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current[0] in captures)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])

    @contextlib.contextmanager
    def device(d):
        before, current[0] = current[0], torch.device(d).index
        try:
            yield
        finally:
            current[0] = before
    monkeypatch.setattr(torch.cuda, "device", device)
    assert launch.capturing(torch.device("cuda", 0)) and launch.capturing(torch.device("cuda"))
    assert not launch.capturing(torch.device("cuda", 1)) and current == [0]
    captures.add(1)
    assert launch.capturing(torch.device("cuda", 1)) and current == [0]
    assert not launch.capturing(torch.device("cpu"))


def test_capturing_sees_a_cuda_graph_tree_warming_up_on_its_stream(monkeypatch):
    # inductor's CUDA graph trees warm a graph up uncaptured on the tree manager's stream: a call then keeps nothing.
    # The trees' state is read, never made: no container for another device or in a thread torch did not start
    # (their accessors assert there: the fresh-thread launch test failed so on the GPU), and no error escapes.
    import threading
    import types

    import torch._inductor.cudagraph_trees as trees

    stream, other = object(), object()
    current = [stream]
    manager = types.SimpleNamespace(stream=stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: current[0])
    containers = {0: types.SimpleNamespace(tree_manager=manager), 1: types.SimpleNamespace(tree_manager=None)}
    monkeypatch.setattr(trees.local, "tree_manager_containers", containers, raising=False)

    def accessor(*args, **kwargs):  # torch 2.11's get_obj asserts in a thread autograd did not start
        raise AssertionError("a trees accessor was called")
    for name in ("get_obj", "get_container", "get_manager"):
        monkeypatch.setattr(trees, name, accessor)
    assert launch.capturing(torch.device("cuda", 0)) and launch.capturing(torch.device("cuda"))
    assert not launch.capturing(torch.device("cuda", 1)) and not launch.capturing(torch.device("cuda", 2))
    assert not launch.capturing(torch.device("cpu")) and set(containers) == {0, 1}
    current[0] = other  # the graph's replays and eager calls run on other streams
    assert not launch.capturing(torch.device("cuda", 0))
    current[0] = stream
    seen = []
    thread = threading.Thread(target=lambda: seen.append(launch.capturing(torch.device("cuda", 0))))
    thread.start()
    thread.join()
    assert seen == [False]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: 1 / 0)
    assert not launch.graph_tree_warmup(torch.device("cuda", 0))
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees")
    assert not launch.graph_tree_warmup(torch.device("cuda", 0))


def test_tensors_device_reads_the_first_tensor():
    assert launch.tensors_device((None, 3, torch.empty(2), 1.0)) is None  # a CPU tensor
    assert launch.tensors_device((None, 3)) is None
    assert isinstance(launch.on_device(torch.empty(2)), contextlib.nullcontext)


def test_kernels_that_return_no_compiled_kernel_always_take_their_own_path(fake_driver):
    # the interpreter's kernels (and test doubles) return None: nothing to bind
    calls = []

    class Interpreted:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(args)

    bound = BoundLaunch(Interpreted(), (1, 1, 1), {})
    bound(1, 2)
    bound(1, 2)
    assert calls == [(1, 2), (1, 2)] and bound.compiled is None


def test_verification_catches_a_key_that_misses_a_specialization(fake_driver, monkeypatch):
    monkeypatch.setattr(BoundLaunch, "verify", True)
    kernel = FakeKernel()
    bound = BoundLaunch(kernel, (1,), dict(BLOCK=16))
    bound(None, 32, 1.0)
    bound(None, 48, 2.0)  # 48 is still divisible by 16; floats are not specialized: fine
    with pytest.raises(AssertionError, match="fake_kernel_fn: a bound launch got arguments that Triton specializes"):
        bound(None, 40, 1.0)  # 40 % 16 != 0: a caller whose key missed the stride
    assert len(kernel.compiled.launches) == 1


def test_a_new_bound_launch_adopts_a_binary_of_the_same_specialization(fake_driver, monkeypatch):
    """A call plan for a new length makes new BoundLaunch objects: one whose arguments specialize as
    an earlier one's did (same kernel and constexprs) binds that compiled kernel without Triton's
    path and launches it on its own grid; other constexprs, another int class (40 % 16 != 0), a
    misaligned tensor or another device take Triton's path."""
    monkeypatch.setattr(BoundLaunch, "shared", {})
    kernel = FakeKernel()
    x = torch.empty(8)
    BoundLaunch(kernel, (3,), dict(BLOCK=64))(x, 32, 0.5)
    assert len(kernel.normal) == 1
    adopted = BoundLaunch(kernel, (5, 2), dict(BLOCK=64))
    adopted(torch.empty(4), 48, 0.25)
    assert len(kernel.normal) == 1 and adopted.compiled is kernel.compiled
    assert kernel.compiled.launches[-1][:3] == (5, 2, 1) and kernel.compiled.launches[-1][-2:] == (64, True)
    for other, args in ((dict(BLOCK=32), (x, 32, 0.5)), (dict(BLOCK=64), (x, 40, 0.5)),
                        (dict(BLOCK=64), (torch.empty(9)[1:], 32, 0.5))):
        BoundLaunch(kernel, (3,), other)(*args)
    assert len(kernel.normal) == 4
    fake_driver.device = 1
    BoundLaunch(kernel, (3,), dict(BLOCK=64))(x, 32, 0.5)
    assert len(kernel.normal) == 5


def test_argument_signature_separates_what_triton_specializes():
    sig = launch.argument_signature
    x = torch.empty(8)
    assert sig([x, 32, 0.5, None]) == sig([torch.empty(4), 48, 0.25, None])
    for other in ([x, 40, 0.5, None], [x, 1, 0.5, None], [x, 2**32, 0.5, None], [x, True, 0.5, None],
                  [x.half(), 32, 0.5, None], [torch.empty(9)[1:], 32, 0.5, None], [x, 32, 0.5, False]):
        assert sig(other) != sig([x, 32, 0.5, None]), other
    assert sig([1]) != sig([True])
    assert sig([x, object()]) is None  # a kind it does not know (a tensor descriptor, say): no sharing


def test_verification_catches_a_signature_that_misses_a_specialization(fake_driver, monkeypatch):
    """A binder that specializes on something argument_signature ignores (here a float's value):
    FLASHGEN_VERIFY_LAUNCH refuses the adopted binary."""
    monkeypatch.setattr(BoundLaunch, "shared", {})
    monkeypatch.setattr(BoundLaunch, "verify", True)
    kernel = FakeKernel()
    binder = kernel.binder
    kernel.binder = lambda *a, **kw: (lambda r: (r[0], [*r[1], a[2]], r[2]))(binder(*a, **kw))
    kernel.device_caches = {0: (None, None, None, None, kernel.binder)}
    BoundLaunch(kernel, (1,), dict(BLOCK=16))(None, 32, 1.0)
    BoundLaunch(kernel, (1,), dict(BLOCK=16))(None, 48, 1.0)  # the same float: fine
    with pytest.raises(AssertionError, match="argument_signature gave two launches one key"):
        BoundLaunch(kernel, (1,), dict(BLOCK=16))(None, 32, 2.0)


# ---------------------------------------------------------------------------------------------- call plans
def _inputs(shape, dtype=torch.float16, *, offset=0, pad=0, seed=0):
    """A tensor of `shape` whose storage starts `offset` elements in and whose last dim is padded
    by `pad` (so its strides are not the contiguous ones)."""
    gen = torch.Generator().manual_seed(seed)
    *lead, d = shape
    full = torch.randn(offset + torch.Size(lead).numel() * (d + pad), generator=gen).to(dtype)
    return full[offset:].view(*lead, d + pad)[..., :d]


CASES = {
    "contiguous": dict(),
    "padded head dim (strides not divisible by 16)": dict(pad=8),
    "misaligned base (2-byte offset)": dict(offset=1),
    "both": dict(offset=3, pad=5),
}


def _module(spec, config=None):
    return flashgen.compile(spec, config).module()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.interpreter
def test_planned_calls_are_bitwise_the_calls_planned_afresh(case, monkeypatch):
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=True)
    module = _module(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1, BLOCK_M1=16, BLOCK_N1=16,
                                        BLOCK_M2=16, BLOCK_N2=16))
    q = _inputs((2, 4, 21, 16), seed=1, **CASES[case])
    k, v = (_inputs((2, 2, 37, 16), seed=s, **CASES[case]) for s in (2, 3))
    do = _inputs((2, 4, 21, 16), seed=4)
    plans = module._LAUNCHER.plans
    plans.clear()
    first = module.forward(q, k, v)
    again = module.forward(q, k, v)  # the cached plan
    assert len(plans) == 1
    grads = module.backward(do, q, k, v, *again)[:3]
    grads_again = module.backward(do, q, k, v, *again)[:3]
    assert len(plans) == 2
    monkeypatch.setattr(BoundLaunch, "enabled", False)  # every call checked and planned afresh
    fresh = module.forward(q, k, v)
    fresh_grads = module.backward(do, q, k, v, *fresh)[:3]
    assert len(plans) == 2
    for a, b, c in zip((*first, *grads), (*again, *grads_again), (*fresh, *fresh_grads)):
        assert torch.equal(a, b) and torch.equal(b, c)
    assert_attention_close(*again, q, k, v, causal=True)
    assert_gradients_close(grads, q, k, v, do, causal=True)


@pytest.mark.interpreter
def test_an_unchanged_call_is_checked_once(monkeypatch):
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, backward=True)
    module = _module(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1))
    launcher = module._LAUNCHER
    launcher.plans.clear()
    checks = []
    original = launcher.check_inputs
    monkeypatch.setattr(launcher, "check_inputs", lambda *a: checks.append(1) or original(*a))
    q, k, v = (_inputs((1, 2, 20, 16), seed=s) for s in range(3))
    for _ in range(3):
        out, lse = module.forward(q, k, v)
        module.backward(out, q, k, v, out, lse)
    assert checks == [1, 1]  # the forward's and the backward's first calls
    module.forward(q, k, v.clone())  # same metadata, other tensor: still planned
    assert checks == [1, 1]


@pytest.mark.interpreter
def test_named_tensor_calls_take_the_flat_key(monkeypatch):
    # a mask's call with its named tensors keys its plan flat (AttentionLauncher.dense_key): one plan per
    # metadata of the ids (the same ids again: the same plan, found by api's fast path with no plan key), each
    # call right
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, mask={"document": {}}, backward=True)
    kernel = flashgen.compile(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1))
    launcher = kernel.module()._LAUNCHER
    launcher.plans.clear()
    kernel._fast.clear()  # (the compiled kernel is shared: another test's calls of these ids left fast entries)
    keys = []
    plan_key, dense_key = launcher.plan_key, launcher.dense_key
    monkeypatch.setattr(launcher, "plan_key", lambda *a: keys.append("plan") or plan_key(*a))
    monkeypatch.setattr(launcher, "dense_key", lambda *a: keys.append("dense") or dense_key(*a))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 20, 16, generator=gen).half() for _ in range(3))
    ids = torch.tensor([[0] * 8 + [1] * 12, [0] * 15 + [1] * 5], dtype=torch.int32)
    made = []
    for doc in (ids, ids, ids[:1], ids.long(), ids.t().contiguous().t()):
        before = len(keys)
        out = kernel(q, k, v, document_ids=doc)
        made.append(len(keys) > before)
        assert_attention_close(out, None, q, k, v, causal=False, mask=spec.mask, tensors={"document_ids": doc})
    assert set(keys) == {"dense"} and made == [True, False, True, True, True] and len(launcher.plans) == 4


@pytest.mark.interpreter
def test_a_training_step_keys_and_checks_its_calls_once(monkeypatch):
    """An autograd step's backward runs the backward plan hung off its forward's plan: one plan key
    per step (was two: the backward keyed q, k, v, out, lse, ... again) and, for packed sequences,
    one read of the offsets (was two). A dO of other strides gets a backward plan of its own; the
    gradients are bitwise those of module.backward planned afresh."""
    from flashgen.runtime import host

    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, causal=True, backward=True)
    kernel = flashgen.compile(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1, BLOCK_M1=16, BLOCK_N1=16,
                                                 BLOCK_M2=16, BLOCK_N2=16))
    module = kernel.module()
    launcher = module._LAUNCHER
    launcher.plans.clear()
    keys, reads = [], []
    plan_key, dense_key, check = launcher.plan_key, launcher.dense_key, host.check_cu_seqlens
    monkeypatch.setattr(launcher, "plan_key", lambda *a: keys.append(a[0][0]) or plan_key(*a))
    monkeypatch.setattr(launcher, "dense_key", lambda *a: keys.append("dense") or dense_key(*a))
    monkeypatch.setattr(host, "check_cu_seqlens", lambda *a: reads.append(1) or check(*a))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen).half().requires_grad_() for _ in range(3))
    do = torch.randn(1, 2, 20, 16, generator=gen).half()
    do_t = do.transpose(2, 3).contiguous().transpose(2, 3)  # the same values, other strides
    for grad_out in (do, do, do_t):
        out = kernel(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        assert_gradients_close(grads, q, k, v, do, causal=True)
    # dense q, k, v and nothing else: the flat key (AttentionLauncher.dense_key), made by the first step and by
    # api's fast path finding that step's plan; later steps (the kernel's fast path) make none
    assert keys == ["dense"] * 2
    (plan,) = launcher.plans.values()
    assert len(plan.backward_plans) == 2  # dO contiguous, dO transposed
    monkeypatch.setattr(BoundLaunch, "enabled", False)
    fresh = module.backward(do, q.detach(), k.detach(), v.detach(), *module.forward(q.detach(), k.detach(),
                                                                                   v.detach()))[:3]
    assert all(torch.equal(a, b) for a, b in zip(grads, fresh))
    monkeypatch.setattr(BoundLaunch, "enabled", True)

    packed = [t.detach().transpose(1, 2).reshape(20, 2, 16).requires_grad_() for t in (q, k, v)]
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    do_p = do.transpose(1, 2).reshape(20, 2, 16)
    keys.clear()
    for _ in range(2):
        grads = torch.autograd.grad(kernel.varlen(*packed, cu, cu, 13, 13), packed, do_p)
    assert keys == ["fwd"] * 2 and reads == [1, 1]  # the forward's reads only
    args = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=13, max_seqlen_k=13)
    plain = [t.detach() for t in packed]
    fresh = module.backward(do_p, *plain, *module.forward(*plain, **args), **args)[:3]
    assert all(torch.equal(a, b) for a, b in zip(grads, fresh))


@pytest.mark.interpreter
def test_a_stride_or_alignment_change_gets_its_own_plan():
    """One tensor at a time stops being 16-aligned or 16-strided: each call gets a plan of its own
    (Triton specializes on both) and is still right."""
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, causal=True)
    module = _module(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1))
    plans = module._LAUNCHER.plans
    plans.clear()
    base = [_inputs((1, 2, 33, 16), seed=s) for s in range(3)]
    variants = [base, [_inputs((1, 2, 33, 16), seed=0, pad=8), *base[1:]],
                [base[0], _inputs((1, 2, 33, 16), seed=1, offset=1), base[2]],
                [*base[:2], _inputs((1, 2, 33, 16), seed=2, offset=2, pad=1)]]
    for i, (q, k, v) in enumerate(variants):
        out, lse = module.forward(q, k, v)
        assert len(plans) == i + 1
        assert_attention_close(out, lse, q, k, v, causal=True)


@pytest.mark.interpreter
def test_tensor_descriptors_are_rebased_onto_each_call(monkeypatch):
    """With TMA the plan keeps descriptors of the first call's metadata and no tensor; each call's
    descriptors point at that call's tensors."""
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, causal=True, backward=True)
    module = _module(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1, tma=True, bwd_tma=True,
                                        BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16))
    launcher = module._LAUNCHER
    launcher.plans.clear()
    seen = []
    original = launcher.forward_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append(args[8:12])
                return original[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(launcher, "forward_kernel", Spy())
    for seed in (0, 10):
        q, k, v = (_inputs((1, 2, 40, 16), seed=seed + s) for s in range(3))
        out, lse = module.forward(q, k, v)
        assert_attention_close(out, lse, q, k, v, causal=True)
        assert all(d.base is t for d, t in zip(seen[-1], (q, k, v, out)))
        do = _inputs(out.shape, seed=seed + 5)
        assert_gradients_close(module.backward(do, q, k, v, out, lse)[:3], q, k, v, do, causal=True)
    (plan,) = [p for p in launcher.plans.values() if hasattr(p, "descriptors")]
    assert plan.descriptors.templates and all(fields["base"] is None for _, fields in plan.descriptors.templates)
    assert all(a.block_shape == b.block_shape and a.strides == b.strides for a, b in zip(*seen))


@pytest.mark.interpreter
def test_a_bad_call_after_a_good_one_still_names_the_argument():
    q, k, v = (_inputs((1, 2, 9, 16), seed=s) for s in range(3))
    flashgen.attention(q, k, v, causal=True)
    flashgen.attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="k: expected dtype torch.float16"):
        flashgen.attention(q, k.float(), v, causal=True)
    with pytest.raises(ValueError, match=r"v: expected seqlen 9 \(the seqlen of k\), got 8"):
        flashgen.attention(q, k, v[:, :, :8], causal=True)
    with pytest.raises(ValueError, match=r"q: expected a 4-d tensor"):
        flashgen.attention(q[0], k, v, causal=True)
    with pytest.raises(TypeError, match="v: expected a torch.Tensor, got list"):
        flashgen.attention(q, k, [1], causal=True)
    module = _module(AttentionSpec(dtype="fp16", head_dim=16, num_heads=2))
    module.forward(q, k, v)
    with pytest.raises(ValueError, match=r"k: expected \(batch, heads, head_dim\) = \(1, 2, 16\)"):
        module.forward(q, k[:, :1], v)
    out, lse = module.forward(q, k, v)
    with pytest.raises(ValueError, match=r"do: expected shape \(1, 2, 9, 16\)"):
        module.backward(out[:, :1], q, k, v, out, lse)


@pytest.mark.parametrize("shape", [(1, 16, 128, 128), (2, 3, 1, 1), (1, 16, 1, 128), (1, 1, 1, 1), (4, 0, 8), (7,)])
def test_allocator_gives_contiguous_tensors(shape):
    # empty_like of an expanded 0-d template where that is contiguous; torch.empty for one element or none
    for dtype in (torch.float16, torch.float32):
        t = launch.allocator(shape, dtype, torch.device("cpu"))()
        assert t.shape == shape and t.dtype == dtype and t.stride() == torch.empty(shape).stride()


@pytest.mark.interpreter
def test_a_dense_training_call_keeps_five_tensors_and_out_follows_qs_memory_order():
    """A dense call without dropout or named tensors keeps q, k, v, out, lse for its backward (its seed
    is never read and it has no offsets); packed sequences keep the seed and offsets too. out is
    contiguous in q's layout, or, for a bhsd q viewing bshd memory, in that memory's order
    (test_bhsd_views_of_bshd_memory_keep_their_memory_order)."""
    q, k, v = (_inputs((1, 2, 9, 16), seed=s).clone().requires_grad_() for s in range(3))
    out = flashgen.attention(q, k, v, causal=True)
    assert len(out.grad_fn.saved_tensors) == 5
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert all(g.is_contiguous() and g._base is None for g in grads)  # three allocations, not views
    packed = [t.detach().transpose(1, 2).reshape(9, 2, 16).requires_grad_() for t in (q, k, v)]
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    assert len(flashgen.attention_varlen(*packed, cu, cu, 5, 5, causal=True).grad_fn.saved_tensors) == 8
    # a dense call with named tensors keeps them beside the five (no seed, no offsets), and its gradients are the
    # reference's (a bool mask's tensor and a float bias's, the bias differentiated too)
    keep = torch.rand(9, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    bias = _inputs((9, 9), seed=4).clone().requires_grad_()
    masked = flashgen.attention(q, k, v, mask="keep[q_idx, kv_idx] != 0", score_mod="score + bias[q_idx, kv_idx]",
                                keep=keep, bias=bias)
    assert len(masked.grad_fn.saved_tensors) == 7
    do = _inputs((1, 2, 9, 16), seed=5)
    ours = torch.autograd.grad(masked, (q, k, v, bias), do)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref = torch.nn.functional.scaled_dot_product_attention(
        *ref_leaves[:3], attn_mask=ref_leaves[3].masked_fill(~keep, float("-inf")))
    for got, want in zip(ours, torch.autograd.grad(ref, ref_leaves, do.double())):
        torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-3)
    q_t = q.detach().transpose(1, 2).contiguous().transpose(1, 2)  # bhsd view of bshd memory
    out_t = flashgen.attention(q_t, k, v, causal=True)
    assert out_t.stride() == q_t.stride() and torch.equal(out_t, out)


@pytest.mark.parametrize("kv_heads,kv_memory", [(2, "bshd"), (1, "bshd"), (2, "bhsd")])
@pytest.mark.interpreter
def test_bhsd_views_of_bshd_memory_keep_their_memory_order(kv_heads, kv_memory):
    """A bhsd call whose q views (batch, seq, heads, dim) memory, as transformers hands it (its projection
    viewed and transposed; k and v come from its KV cache contiguous): the call runs as bshd, so out and dq
    are bhsd views of bshd memory with q's strides (the caller's out.transpose(1, 2) is contiguous), dk and
    dv views of bshd memory too, all equal to a contiguous call's; the autograd graph holds the attention
    node alone. A call refused so is refused in the caller's own layout."""
    seed = random.randrange(2**31)
    views = [_inputs((2, 9, h, 16), seed=seed + i).transpose(1, 2) for i, h in enumerate((2, kv_heads, kv_heads))]
    if kv_memory == "bhsd":
        views[1:] = [t.contiguous() for t in views[1:]]
    views = [t.requires_grad_() for t in views]
    plain = [t.detach().contiguous().requires_grad_() for t in views]
    do = _inputs((2, 9, 2, 16), seed=seed + 3).transpose(1, 2)
    out, ref = flashgen.attention(*views, causal=True), flashgen.attention(*plain, causal=True)
    assert out.stride() == views[0].stride() and out.transpose(1, 2).is_contiguous()
    assert all(fn is None or type(fn).__name__ == "AccumulateGrad" for fn, _ in out.grad_fn.next_functions)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    grads, ref_grads = torch.autograd.grad(out, views, do), torch.autograd.grad(ref, plain, do)
    for g, r, t in zip(grads, ref_grads, views):
        assert g.transpose(1, 2).is_contiguous(), f"seed={seed}"
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert grads[0].stride() == views[0].stride()
    # (out may be changed in place, as a call's own output, not as a view made inside the autograd function)
    flashgen.attention(*views, causal=True).transpose(1, 2).reshape(2, 9, 32).mul_(2)
    with torch.no_grad():
        inference = flashgen.attention(*views, causal=True)
    assert inference.stride() == views[0].stride() and torch.equal(inference, ref)
    with pytest.raises(ValueError, match=r"k: expected .* in layout 'bhsd', got \(1, "):
        flashgen.attention(views[0], views[1][:1], views[2], causal=True)


@pytest.mark.interpreter
def test_calls_that_cannot_need_a_gradient_skip_the_autograd_function(monkeypatch):
    applied = []
    original = ops._apply_function  # AttentionFunction.apply's C++ half, the eager entry
    monkeypatch.setattr(ops, "_apply_function", lambda *a: applied.append(1) or original(*a))
    q, k, v = (_inputs((1, 2, 9, 16), seed=s) for s in range(3))
    plain = flashgen.attention(q, k, v, causal=True)
    assert not applied and not plain.requires_grad
    q.requires_grad_()
    with torch.no_grad():
        assert torch.equal(flashgen.attention(q, k, v, causal=True), plain) and not applied
    out = flashgen.attention(q, k, v, causal=True)
    assert applied == [1] and out.requires_grad and torch.equal(out.detach(), plain)


@pytest.mark.interpreter
def test_the_eager_entry_falls_back_to_apply_where_torch_lacks_its_internals(monkeypatch):
    import types

    assert ops._function_entry(ops.AttentionFunction, types.SimpleNamespace()) is None  # a torch without them
    assert ops._function_entry(ops.AttentionFunction, torch._C) is not None  # this torch: the C++ half
    monkeypatch.setattr(ops, "_ENTRY", None)
    q, k, v = (_inputs((1, 2, 9, 16), seed=s).requires_grad_() for s in range(3))
    out = flashgen.attention(q, k, v, causal=True)
    out.sum().backward()
    monkeypatch.undo()
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out_ref = flashgen.attention(*ref, causal=True)
    out_ref.sum().backward()
    assert torch.equal(out, out_ref) and all(torch.equal(a.grad, b.grad) for a, b in zip((q, k, v), ref))


# ---------------------------------------------------------------------------------------------- Triton's own path, on the CPU
SM90_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import sm90_compile  # noqa: E402
import torch  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402
from triton.runtime import driver  # noqa: E402

driver.set_active(sm90_compile.Sm90Driver())
runs, triton_paths = [], []


def init_handles(self):  # no GPU: the launcher records what it would launch
    if self.module is None:
        self.module, self.function = "sm90", 1
        self._run = lambda *args, kernel=self: runs.append((kernel, args))


CompiledKernel._init_handles = init_handles
run = jit.JITFunction.run
jit.JITFunction.run = lambda self, *a, **kw: triton_paths.append(self.__name__) or run(self, *a, **kw)

import flashgen  # noqa: E402
from flashgen import AttentionSpec, KernelConfig  # noqa: E402
from flashgen.runtime.launch import BoundLaunch  # noqa: E402

BoundLaunch.verify = True  # every bound launch also asks Triton's binder


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
    if hasattr(a, "block_shape"):  # a tensor descriptor
        return (same(a.base, b.base) and list(a.shape) == list(b.shape) and list(a.strides) == list(b.strides)
                and list(a.block_shape) == list(b.block_shape))
    return type(a) is type(b) and a == b


def compare(name, normal, bound):
    assert len(normal) == len(bound) > 0, (name, len(normal), len(bound))
    for (kernel, n), (kernel_b, b) in zip(normal, bound):
        assert kernel is kernel_b, name
        assert n[:6] == b[:6], (name, n[:6], b[:6])  # grid, stream, function, packed metadata
        assert b[6:9] == (None, None, None), name  # no launch metadata, no hooks
        assert len(n) == len(b) and all(same(x, y) for x, y in zip(n[9:], b[9:])), name
    print(f"ok {name}: {len(bound)} launches, {len(bound[0][1]) - 9} arguments each")


spec = AttentionSpec(dtype="bf16", head_dim=64, num_heads=4, num_kv_heads=2, causal=True, backward=True)
tiles = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32)
q, k, v = (torch.randn(2, h, 200, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
cu = torch.tensor([0, 150, 400], dtype=torch.int32)
packed = [t.transpose(1, 2).reshape(400, t.shape[1], 64) for t in (q, k, v)]
modules = {}
for name, config in (("pointer loads", KernelConfig(**tiles)),
                     ("tensor descriptors", KernelConfig(**tiles, tma=True, bwd_tma=True))):
    module = modules[name] = flashgen.compile(spec, config).module()
    module._LAUNCHER.interpreting = lambda: True  # accept CPU tensors: nothing runs
    calls = {"forward": lambda: module.forward(q, k, v),
             "backward": lambda: module.backward(q, q, k, v, q, torch.zeros(2, 4, 200)),
             "packed forward": lambda: module.forward(*packed, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                      max_seqlen_q=250, max_seqlen_k=250)}
    for phase, call in calls.items():
        runs.clear(), triton_paths.clear()
        call()
        normal = list(runs)
        runs.clear(), triton_paths.clear()
        call()
        assert not triton_paths, triton_paths  # the second call never entered JITFunction.run
        compare(f"{name} {phase}", normal, list(runs))
# A misaligned q: a new plan, Triton's path, another binary (Q's alignment is specialized).
module = modules["pointer loads"]
module.forward(q, k, v)
aligned = runs[-1][0]
runs.clear(), triton_paths.clear()
shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)
module.forward(shifted, k, v)
assert triton_paths == ["_attn_fwd"] and runs[-1][0] is not aligned, "a misaligned q must not share a binary"
print("ok misaligned q: its own plan and binary")
# A new sequence length whose arguments Triton specializes alike (216 = 200 mod 16): a new plan
# whose launches bind the binaries already compiled (no Triton path), with Triton's arguments.
longer = [torch.randn(2, h, 216, 64, dtype=torch.bfloat16) for h in (4, 2, 2)]
calls = {"forward": lambda: module.forward(*longer),
         "backward": lambda: module.backward(longer[0], *longer, longer[0], torch.zeros(2, 4, 216))}
for phase, call in calls.items():
    runs.clear(), triton_paths.clear()
    call()
    assert not triton_paths, (phase, triton_paths)
    adopted = list(runs)
    shared, BoundLaunch.shared = BoundLaunch.shared, {}  # nothing to adopt: Triton's path
    module._LAUNCHER.plans.clear()
    runs.clear(), triton_paths.clear()
    call()
    assert triton_paths, phase
    BoundLaunch.shared = shared
    compare(f"new length {phase}", list(runs), adopted)
# Decode-shaped calls (2 queries over bshd views of (B, H_kv, S, D) caches, as transformers passes
# them): one length-free plan. After 207 and 208 (seqlen_k % 16 != 0 and == 0: two binaries), each
# new length launches bound (no Triton path, no forward_plan) with what Triton's path gets for a plan
# made afresh.
launcher = module._LAUNCHER
q2 = torch.randn(2, 2, 4, 64, dtype=torch.bfloat16)
caches = {s: torch.randn(2, 2, s, 64, dtype=torch.bfloat16).transpose(1, 2) for s in (207, 208, 209, 224, 241)}
module.forward(q2, caches[207], caches[207], layout="bshd")
module.forward(q2, caches[208], caches[208], layout="bshd")
planned = launcher.forward_plan
launcher.forward_plan = None  # a decode-shaped call of a new length must not plan
for s in (209, 224, 241):
    runs.clear(), triton_paths.clear()
    module.forward(q2, caches[s], caches[s], layout="bshd")
    assert not triton_paths, (s, triton_paths)
    spliced = list(runs)
    launcher.forward_plan = planned
    BoundLaunch.enabled = False  # Triton's path, planned afresh
    runs.clear()
    module.forward(q2, caches[s], caches[s], layout="bshd")
    BoundLaunch.enabled = True
    launcher.forward_plan = None
    compare(f"decode length {s}", list(runs), spliced)
launcher.forward_plan = planned
"""


def test_bound_launches_pass_what_tritons_path_passes(tmp_path):
    env = dict(os.environ, PYTHONPATH=child_pythonpath(ROOT), FLASHGEN_CACHE_DIR=str(tmp_path / "flashgen"),
               TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", SM90_CHILD, str(ROOT / "tests")], env=env, capture_output=True,
                          text=True, timeout=900)
    if "sm90_compile" in proc.stderr and "unsupported triton" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    for name in ("pointer loads", "tensor descriptors"):
        for phase in ("forward", "backward", "packed forward"):
            assert any(line.startswith(f"ok {name} {phase}:") for line in lines), (name, phase, proc.stdout)
    assert "ok misaligned q: its own plan and binary" in lines
    assert any(line.startswith("ok new length forward:") for line in lines), proc.stdout
    assert any(line.startswith("ok new length backward:") for line in lines), proc.stdout
    assert all(any(line.startswith(f"ok decode length {s}:") for line in lines) for s in (209, 224, 241)), proc.stdout


TRITON36_WRAPPER = """
class CudaLauncher:
    def __call__(self, gridX, gridY, gridZ, stream, function, *args):  # (no scratch memory: None for both)
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, None,
                    None, *args)


def wrap_handle_tensordesc(launcher, tensordesc_indices, tensordesc_meta):
    def inner(*args):
        final_args = list(args[:_BASE_ARGS_FORMAT_LEN])
        tensordesc_idx = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)
    return inner
"""  # triton 3.6's nvidia driver.py, its shape: the names RawLaunch.of reads, CudaLauncher.__call__ cut to its end


def _triton36_launcher(module, slots, record, metas=True):
    """A stand-in for triton 3.6's CudaLauncher of a kernel whose arguments `slots` are tensor
    descriptors (metas: with tensor-map metadata, else None as for a GPU without TMA), its class and
    wrapper defined in `module` as 3.6's are in its driver module."""
    if not hasattr(module, "wrap_handle_tensordesc"):
        exec(TRITON36_WRAPPER, module.__dict__)
    made = module.CudaLauncher()
    meta = [{"block": i} for i in range(len(slots))] if metas else None
    made.launch = module.wrap_handle_tensordesc(record, set(slots), meta or [None] * len(slots)) \
        if slots else functools.partial(record)  # (3.6's C launcher itself: no Python code)
    made.global_scratch_size = made.profile_scratch_size = 0
    made.launch_cooperative_grid, made.launch_pdl = False, True
    return made


def test_raw_launch_passes_what_tritons_launcher_passes(monkeypatch):
    """RawLaunch (triton 3.6's launcher without its Python layers) calls the C launcher with the arguments
    3.6's wrapper would, each descriptor's expansion made once per base pointer; launchers of another
    shape get no RawLaunch (Triton's path)."""
    import types

    fake = types.ModuleType("fake_triton36_driver")
    made = []

    def make_tensordesc_arg(desc, meta):
        made.append(desc.base.data_ptr())
        if meta is None:  # as 3.6's: the tensor itself, its shape and strides
            return [desc.base, *desc.shape, *desc.strides]
        return [("map", desc.base.data_ptr(), meta["block"]), *desc.shape, *desc.strides]

    fake.make_tensordesc_arg, fake._BASE_ARGS_FORMAT_LEN = make_tensordesc_arg, 13
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(launch.RawLaunch, "TRITON", "")  # whatever Triton this is: the stand-in is 3.6's
    calls = []
    desc = lambda t: types.SimpleNamespace(base=t, shape=list(t.shape), strides=list(t.stride()))  # noqa: E731
    compiled = types.SimpleNamespace(function=77, packed_metadata=("meta",))
    for slots in ((0, 2), ()):
        compiled._run = _triton36_launcher(fake, slots, lambda *a: calls.append(a))
        raw = launch.RawLaunch.of(compiled, (3, 2, 1), 4)
        assert raw is not None and raw.slots == slots
        tensors = [torch.empty(4, 8), torch.empty(2, 8)]
        for step in range(3):
            t = tensors[step % 2]
            args = (desc(t) if slots else t, 5, desc(t) if slots else t, torch.empty(1))
            calls.clear()
            raw(0xABC, args, (True, 64))
            ours = calls.pop()
            # Triton's path (BoundLaunch's compiled.run call): the same arguments reach the C launcher, but for
            # each tensor, which RawLaunch gives as its address (the C launcher's int pointer)
            compiled._run(3, 2, 1, 0xABC, 77, ("meta",), None, None, None, *args, True, 64)
            assert ours == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in calls.pop())
            assert any(isinstance(a, torch.Tensor) for a in args) and not any(isinstance(a, torch.Tensor) for a in ours)
        # a call with None where the first call had a tensor: passed as given; with addresses off, every tensor
        raw(0xABC, (*args[:3], None), (True, 64))
        assert calls.pop()[-3] is None
        monkeypatch.setattr(launch.RawLaunch, "addresses", False)
        raw(0xABC, args, (True, 64))
        assert calls.pop()[-3] is args[3]
        monkeypatch.setattr(launch.RawLaunch, "addresses", True)
        # tensors[0], in both descriptors of steps 0 and 2: 4 expansions by Triton's wrapper, here 1 per slot
        assert made.count(tensors[0].data_ptr()) == (6 if slots else 0)
    compiled._run = _triton36_launcher(fake, (0,), lambda *a: calls.append(a), metas=False)  # no maps: none kept
    raw = launch.RawLaunch.of(compiled, (1, 1, 1), 2)
    raw(0, (desc(tensors[0]), 5), ())
    assert calls.pop()[13] is tensors[0] and raw.expanded == [{}]
    compiled._run.global_scratch_size = 128  # a kernel with scratch memory: Triton's path
    assert launch.RawLaunch.of(compiled, (1, 1, 1), 4) is None
    compiled._run = _triton36_launcher(fake, (5,), calls.append)  # a descriptor past the positionals
    assert launch.RawLaunch.of(compiled, (1, 1, 1), 4) is None
    monkeypatch.delattr(fake, "_BASE_ARGS_FORMAT_LEN")  # another Triton's driver
    assert launch.RawLaunch.of(compiled, (1, 1, 1), 8) is None
    fake._BASE_ARGS_FORMAT_LEN = 13
    assert launch.RawLaunch.of(compiled, (1, 1, 1), 8) is not None
    monkeypatch.setattr(launch.RawLaunch, "TRITON", "0.0.")  # another Triton's version
    assert launch.RawLaunch.of(compiled, (1, 1, 1), 8) is None


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    dict(),
    dict(tma=True, bwd_tma=True),
    dict(dq_strategy="atomic"),
    dict(loop_order="kv_outer"),
], ids=["default-tiles", "tma", "atomic-dq", "kv-outer"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_bound_launches_are_bitwise_tritons(config, layout, monkeypatch):
    monkeypatch.setattr(BoundLaunch, "verify", True)
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=8, num_kv_heads=2, causal=True, backward=True)
    kernel = flashgen.compile(spec, KernelConfig(**config))
    shapes = {"bhsd": [(2, h, 300, 128) for h in (8, 2, 2)], "bshd": [(2, 300, h, 128) for h in (8, 2, 2)]}[layout]
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes)
    do = torch.randn(shapes[0], device="cuda", dtype=torch.bfloat16)

    def step():
        out, lse = kernel(q, k, v, layout=layout, return_lse=True, deterministic=config.get("dq_strategy") is None)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), do))

    results = [step() for _ in range(3)]  # Triton's path, then bound twice
    plans = [p for plan in kernel.module()._LAUNCHER.plans.values() for p in (plan, *plan.backward_plans.values())]
    launches = [getattr(plan, name) for plan in plans  # a step's backward plan hangs off its forward's
                for name in ("launch", "preprocess", "dkdv", "dq") if getattr(plan, name, None) is not None]
    assert len(launches) >= 3 and all(b.compiled is not None for b in launches)  # every launch was bound
    monkeypatch.setattr(BoundLaunch, "enabled", False)
    results.append(step())
    if config.get("dq_strategy") == "atomic":  # atomics: not bitwise repeatable, compare to the reference
        results = [r[:2] for r in results]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], r))
    assert_attention_close(*results[0][:2], q, k, v, causal=True, layout=layout)


@pytest.mark.gpu
def test_gpu_a_new_length_adopts_compiled_kernels_bitwise(monkeypatch):
    """fwd+bwd at 300 tokens, then at 316 (the same specialization): the new plans' launches bind the
    binaries compiled for 300 (no Triton path, verified against the binder) and give Triton's results."""
    import triton.runtime.jit as jit

    monkeypatch.setattr(BoundLaunch, "verify", True)
    kernel = flashgen.compile(AttentionSpec(dtype="bf16", head_dim=128, num_heads=8, num_kv_heads=2, causal=True,
                                            backward=True))

    def step(seqlen):
        torch.manual_seed(seqlen)
        q, k, v = (torch.randn(2, h, seqlen, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for h in (8, 2, 2))
        out = kernel(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), torch.randn_like(out)))

    step(300)
    paths, run = [], jit.JITFunction.run
    monkeypatch.setattr(jit.JITFunction, "run", lambda self, *a, **kw: paths.append(self.__name__) or run(self, *a, **kw))
    adopted = step(316)
    assert not paths, paths
    monkeypatch.setattr(BoundLaunch, "enabled", False)
    assert all(torch.equal(a, b) for a, b in zip(adopted, step(316)))


@pytest.mark.gpu
def test_gpu_launch_hooks_see_every_launch():
    """With a launch hook installed, launches take Triton's path, which calls the hook."""
    q, k, v = (torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flashgen.attention(q, k, v, causal=True)
    flashgen.attention(q, k, v, causal=True)  # bound by now
    seen = []

    def record(metadata):  # a LazyDict of the launch: its name, function, stream
        seen.append(metadata.get()["name"])

    hook = launch.triton_knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this Triton takes launch hooks as a plain function")
    hook.add(record)
    try:
        out = flashgen.attention(q, k, v, causal=True)
    finally:
        hook.remove(record)
    assert seen == ["_attn_fwd"]
    assert torch.equal(out, flashgen.attention(q, k, v, causal=True))


@pytest.mark.gpu
def test_gpu_decode_shaped_calls_of_new_lengths_are_bitwise_tritons(monkeypatch):
    """A generation loop's calls (2 queries over bshd views of a (B, H_kv, S, D) cache one longer
    each call) run one length-free plan; each length's output and LSE are bitwise those of a plan
    made afresh through Triton's path, and every launch is verified against Triton's binder."""
    monkeypatch.setattr(BoundLaunch, "verify", True)
    kernel = flashgen.compile(AttentionSpec(dtype="bf16", head_dim=128, num_heads=8, num_kv_heads=2, causal=True))
    launcher = kernel.module(kernel.config_for(129))._LAUNCHER  # one bucket serves 129..161
    q = torch.randn(2, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    storage = torch.randn(2 * 2 * 300 * 128, device="cuda", dtype=torch.bfloat16)
    for seqlen in (129, 130, 144, 160, 161):
        cache = storage[:2 * 2 * seqlen * 128].view(2, 2, seqlen, 128).transpose(1, 2)
        out, lse = kernel(q, cache, cache, layout="bshd", return_lse=True)
        monkeypatch.setattr(BoundLaunch, "enabled", False)
        out_ref, lse_ref = kernel(q, cache, cache, layout="bshd", return_lse=True)
        monkeypatch.setattr(BoundLaunch, "enabled", True)
        assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref), seqlen
    decode = [plan for key, plan in launcher.plans.items() if key and key[0] == "decode"]
    assert len(decode) == 1 and decode[0] and len(decode[0][1]) == 2  # seqlen_k % 16 == 0 or not
    assert_attention_close(out, lse, q, cache, cache, causal=True, layout="bshd")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_hopper_plan_launches_bound_bitwise_tritons(causal, monkeypatch):
    """The hopper_ws forward's plan: Triton's path once, then bound launches with descriptors copied
    onto each call's tensors, bitwise equal to Triton's path every call."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the hopper_ws family runs on sm90")
    import triton.runtime.jit as jit

    monkeypatch.setattr(BoundLaunch, "verify", True)
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=8, num_kv_heads=2, causal=causal)
    kernel = flashgen.compile(spec, KernelConfig(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_warps=4,
                                                 num_stages=2))
    inputs = [[torch.randn(2, h, 1000, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2)]
              for _ in range(2)]
    kernel(*inputs[0])
    paths, run = [], jit.JITFunction.run
    monkeypatch.setattr(jit.JITFunction, "run", lambda self, *a, **kw: paths.append(self.__name__) or run(self, *a, **kw))
    bound = [kernel(*x, return_lse=True) for x in inputs]
    assert not paths, paths
    assert any(type(p).__name__ == "HopperPlan" for p in kernel.module()._LAUNCHER.plans.values())
    monkeypatch.setattr(BoundLaunch, "enabled", False)
    for x, (out, lse) in zip(inputs, bound):
        out_ref, lse_ref = kernel(*x, return_lse=True)
        assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    assert_attention_close(*bound[1], *inputs[1], causal=causal)


@pytest.mark.gpu
def test_gpu_raw_launches_keep_tensor_maps_by_pointer_bitwise(monkeypatch):
    """Training steps on fresh tensors (new pointers, and pointers the allocator hands out again) through
    the Gluon forward and dK/dV kernels: on triton 3.6 their bound launches are RawLaunches that keep each
    descriptor's tensor map by base pointer, bitwise equal to Triton's path (verified: each kept
    expansion against a fresh one)."""
    import triton

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the hopper_ws family runs on sm90")
    monkeypatch.setattr(BoundLaunch, "verify", True)
    used, call = [], launch.RawLaunch.__call__
    monkeypatch.setattr(launch.RawLaunch, "__call__", lambda self, *a: used.append(len(self.slots)) or call(self, *a))
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=8, num_kv_heads=2, causal=True, backward=True)
    kernel = flashgen.compile(spec, KernelConfig(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_warps=4,
                                                 num_stages=2, hopper_bwd=True))

    def step(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(2, 700, h, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for h in (8, 2, 2))
        out = kernel(q, k, v, layout="bshd")
        grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, device="cuda", dtype=out.dtype,
                                                                 generator=gen))
        return [t.clone() for t in (out, *grads)]

    fast = [step(seed) for seed in range(4)]
    if triton.__version__.startswith("3.6."):
        assert max(used) >= 3, used  # the forward's q, k, v descriptors, and the backward's
    monkeypatch.setattr(BoundLaunch, "enabled", False)
    for seed, results in enumerate(fast):
        assert all(torch.equal(a, b) for a, b in zip(results, step(seed))), seed


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["portable", "hopper_ws", "hopper_ws persistent"])
def test_gpu_a_fresh_thread_launches_kernels_with_tensor_descriptors(family):
    """A serving or data-loading thread that made no CUDA call yet: torch's allocator can serve it
    memory without one, so it has no current context when Triton fills the descriptors (before
    host.ensure_context: "Failed to create tensor map descriptor: invalid device context")."""
    import threading

    if family != "portable" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the hopper_ws family runs on sm90")
    config = (KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, tma=True) if family == "portable"
              else KernelConfig(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2,
                                hopper_persistent=family.endswith("persistent")))
    kernel = flashgen.compile(AttentionSpec(dtype="bf16", head_dim=128, num_heads=8, num_kv_heads=2, causal=True),
                              config)
    q, k, v = (torch.randn(2, h, 1000, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    first = kernel(q, k, v)  # this thread: the plan, its descriptors' templates and the memory are made
    del first  # its block goes back to the allocator's cache, for the other thread to take without a CUDA call
    torch.cuda.synchronize()
    got = {}

    def call():
        try:
            got["out"] = kernel(q, k, v)
            torch.cuda.current_stream().synchronize()
        except Exception as err:  # noqa: BLE001 - reported below
            got["error"] = err

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert "error" not in got, got.get("error")
    assert torch.equal(got["out"], kernel(q, k, v))


def test_the_backward_is_handed_no_zero_filled_lse_gradient(device, monkeypatch):
    # lse takes no gradient: autograd materialized a zero-filled dlse for it by default, a float32
    # allocation and a fill launch per training step (40-70 us of an H200 host's ~280 us short step)
    seen = []
    original = ops.AttentionFunction.gradients
    monkeypatch.setattr(ops.AttentionFunction, "gradients",
                        staticmethod(lambda ctx, dout, dlse: seen.append(dlse) or original(ctx, dout, dlse)))
    q, k, v = (_inputs((1, 2, 9, 16), seed=s).to(device).requires_grad_() for s in range(3))
    do = _inputs((1, 2, 9, 16), seed=3).to(device)
    grads = torch.autograd.grad(flashgen.attention(q, k, v, causal=True), (q, k, v), do)
    assert seen == [None]
    assert_gradients_close(grads, q, k, v, do, causal=True)


def test_an_output_that_reaches_no_loss_gives_no_gradients(device):
    # With grads unmaterialized, out reaching the loss only through a node that returns no gradient for it
    # hands the backward dout None: it returns none (before it was handed zeros and launched on them)
    class Ignore(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return y.clone()

        @staticmethod
        def backward(ctx, grad):
            return None, grad

    q, k, v = (_inputs((1, 2, 9, 16), seed=s).to(device).requires_grad_() for s in range(3))
    w = _inputs((1, 2, 9, 16), seed=4).to(device).requires_grad_()
    dq, dw = torch.autograd.grad(Ignore.apply(flashgen.attention(q, k, v, causal=True), w).sum(), (q, w),
                                 allow_unused=True)
    assert dq is None and torch.equal(dw, torch.ones_like(w))


def test_environment_flags_read_the_usual_off_words(monkeypatch):
    # FLASHGEN_SYNC_CHECKS=false (or no, off, 0, empty, in any case) turns a flag off; it read as on before
    from flashgen.runtime.launch import env_flag

    for off in ("", "0", "false", "False", "NO", "off", " off "):
        monkeypatch.setenv("FLASHGEN_TEST_FLAG", off)
        assert env_flag("FLASHGEN_TEST_FLAG", True) is False, off
    for on in ("1", "true", "yes", "on", "2"):
        monkeypatch.setenv("FLASHGEN_TEST_FLAG", on)
        assert env_flag("FLASHGEN_TEST_FLAG", False) is True, on
    monkeypatch.delenv("FLASHGEN_TEST_FLAG")
    assert env_flag("FLASHGEN_TEST_FLAG", True) is True and env_flag("FLASHGEN_TEST_FLAG", False) is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_calls_on_another_device_than_the_current_one_run_on_theirs():
    """cuda:1's tensors with cuda:0 current (a model spread over GPUs): training steps (the default family and the
    portable one), a bool mask's block map, split-KV decode. Each is bitwise the same call with cuda:1 current,
    and cuda:0 stays current."""
    dev = torch.device("cuda", 1)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(2, 8, 300, 128, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    keep = torch.rand(300, 300, device=dev, generator=gen) > 0.3
    kc, vc = (torch.randn(2, 64, 2, 64, device=dev, dtype=torch.float16, generator=gen) for _ in range(2))
    q1 = torch.randn(2, 1, 8, 64, device=dev, dtype=torch.float16, generator=gen)
    decode_spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=8, num_kv_heads=2, causal=True, backward=False)

    def calls():
        results = []
        for config in (None, KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)):
            x = [t.detach().requires_grad_() for t in (q, k, v)]
            out = flashgen.attention(*x, causal=True, config=config)
            results += [out, *torch.autograd.grad(out, x, do)]
        results.append(flashgen.scaled_dot_product_attention(q, k, v, attn_mask=keep))
        results.append(flashgen.decode(decode_spec, q1, kc, vc, torch.tensor([40, 64], dtype=torch.int32, device=dev),
                                       num_splits=3))
        torch.cuda.synchronize(dev)
        return results

    torch.cuda.set_device(0)
    elsewhere = calls()
    assert torch.cuda.current_device() == 0
    with torch.cuda.device(dev):
        here = calls()
    assert all(torch.equal(a, b) for a, b in zip(elsewhere, here))
    assert_attention_close(elsewhere[0], None, q, k, v, causal=True)
