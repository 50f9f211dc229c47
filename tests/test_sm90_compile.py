"""The generated kernels compile for an H100 (sm90) through Triton's full pipeline, with no
GPU: tests/sm90_compile.py drives Triton with a driver that reports an sm90 target and
compiles instead of launching. The interpreter runs the kernels' Python; this checks that
the same code lowers (tensor descriptors, warp specialization, every mask path)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import child_pythonpath

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_compile_for_sm90(tmp_path):
    env = dict(os.environ, PYTHONPATH=child_pythonpath(ROOT), TRITON_CACHE_DIR=str(tmp_path / "triton"),
               FLASHGEN_CACHE_DIR=str(tmp_path / "flashgen"), TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "sm90_compile.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    # 17 + an FP8 forward + 3 hopper_ws and 2 hopper_bwd cases (forward, backward, and a training step:
    # autograd's path) + a hopper_ws FP8 forward + the two FP8 forwards at hd256 (promoted q.k) + 3
    # masked hopper_ws forwards + 2 forwards at documents' default tiles (causal, documents) + 2 persistent
    # hopper_ws cases (forward, backward, training step each) + an FP8 persistent hopper_ws forward + an
    # overlapped and a ping-ponged persistent forward + the wgmma pipelining check + 3 masked hopper_bwd
    # cases (backward only) + 2 forwards writing O by a TMA store (FP8 persistent, masked one-tile) + 3 masked
    # forwards on the persistent grid (and the documents one's training step) + three consumers (one-tile forward;
    # persistent forward, backward, step) + the adding dK/dV kernel's spill check + 16-bit hd256 (one-tile
    # forward, backward, step; a persistent overlapped forward) + two padded head dims on the Gluon forward (hd96's
    # pointer store, hd40's three consumers and TMA store) + four packed-sequence Gluon forwards (one persistent,
    # three on the one-tile grid) + two Gluon FP8-cache decodes (e4m3 over pages, e5m2 split and merged) + a custom
    # mask and bias through the one-launch backward (forward, backward) + an FP8 one-tile forward + the mbarrier check
    assert len([line for line in lines if line.startswith("ok ")]) == 93, proc.stdout
    # no Gluon kernel stores plain values over an initialized mbarrier (the one-tile packed kernel's fault)
    assert any(line.startswith("ok mbarriers: ") for line in lines), proc.stdout
    # the Gluon FP8-cache decode, both cache formats, without a stack (sm90_compile.py checks it)
    for case in ("decode fp8 gluon hd128 causal paged-16, 2 rows", "decode fp8 gluon hd64 e5m2 cache_batch_idx, split"):
        assert any(line.startswith(f"ok {case}: _attn_decode_fp8: 4 warps") for line in lines), (case, proc.stdout)
    # packed sequences on the Gluon forward's packed kernels (sequences of one length: the persistent one where the
    # module is persistent; O by the module's TMA store where a tile lies in its sequence, else by pointers)
    for case, kernel, warps in (("hopper_ws packed sequences gqa causal, overlap", "packed_persistent", 12),
                                ("hopper_ws packed sequences, unequal lengths, overlap", "packed", 12),
                                ("hopper_ws packed sequences hd64, 3 consumers, unequal lengths", "packed", 16),
                                ("hopper_ws packed sequences causal, one tile, ping-pong", "packed", 12)):
        assert any(line.startswith(f"ok {case} forward: _attn_fwd_hopper_ws_{kernel}: {warps} warps") for line in lines), \
            (case, proc.stdout)
    # FA3's overlap (hopper_overlap): ptxas keeps the overlapped forwards' MMAs asynchronous
    assert any(line.startswith("ok wgmma pipelining: ") for line in lines), proc.stdout
    assert any(line.startswith("ok documents' shared memory: ") for line in lines), proc.stdout
    # the Gluon dK/dV kernel adding dQ keeps its K descriptors in its loop (ptxas's stack frame, sm90_compile.py)
    assert any(line.startswith("ok the adding dK/dV kernel's spills: ") for line in lines), proc.stdout
    # the Q-outer forward with TMA and warp specialization, every backward, the masked specs (a pattern, a
    # block map, documents), packed sequences and the persistent dK/dV grid
    for case in ("TMA + warp specialization", "sliding window + softcap", "custom expression (block map)",
                 "documents, FA1 loop order", "packed sequences", "persistent dK/dV"):
        for phase in ("forward", "backward"):
            assert any(line.startswith("ok ") and case in line and f" {phase}: " in line for line in lines), (case,
                                                                                                           phase)
    assert "ok constexpr globals: hd64 and hd128 compile to different binaries" in lines, proc.stdout
    # the TMA + warp-specialized forward uses the copy engine's shared-memory staging
    assert any("TMA + warp specialization forward: _attn_fwd: 8 warps" in line for line in lines), proc.stdout
    # the Gluon forward (family hopper_ws): a producer warp padded to a warpgroup beside each consumer
    # warpgroup (4 + 4 + 4 warps for two consumers, 4 + 4 for one), through ptxas for sm90
    assert any("hopper_ws gqa causal, 2 consumers forward: _attn_fwd_hopper_ws: 12 warps" in line
               for line in lines), proc.stdout
    assert any("hopper_ws hd64, 1 consumer, overlap forward: _attn_fwd_hopper_ws: 8 warps" in line
               for line in lines), proc.stdout
    assert any("hopper_ws hd128, ping-pong forward: _attn_fwd_hopper_ws: 12 warps" in line for line in lines), \
        proc.stdout
    # the persistent grid (hopper_persistent): the same partitions, through ptxas for sm90
    assert any("hopper_ws persistent gqa causal, 2 consumers forward: _attn_fwd_hopper_ws: 12 warps" in line
               for line in lines), proc.stdout
    assert any("hopper_ws persistent hd64, 1 consumer forward: _attn_fwd_hopper_ws: 8 warps" in line
               for line in lines), proc.stdout
    # the training step runs the Gluon forward, then the portable backward from its plan
    for case in ("hopper_ws gqa causal, 2 consumers", "hopper_ws hd64, 1 consumer, overlap", "hopper_ws hd128, ping-pong"):
        assert any(line.startswith(f"ok {case} training step: _attn_fwd_hopper_ws") and "_attn_bwd_dq" in line
                   for line in lines), (case, proc.stdout)
    # the Gluon dK/dV kernel (hopper_bwd): two consumer warpgroups + the producer's, beside the portable
    # preprocess and dQ kernels, under module.backward and autograd's training step, for both forwards
    for case in ("hopper_bwd gqa causal hd128", "hopper_bwd hd64"):
        for phase in ("backward", "training step"):
            assert any(line.startswith(f"ok {case} {phase}: ") and "_attn_bwd_dkdv_hopper: 12 warps" in line
                       and "_attn_bwd_dq" in line and "_attn_bwd_dkdv:" not in line for line in lines), (case, phase)
    # the Gluon forward on FP8 e4m3 (V^T tiles through a transposed descriptor, P as an FP8 register
    # operand): the FP8 call takes it, not the portable FP8 forward
    assert any(line.startswith("ok hopper_ws fp8 e4m3 gqa causal hd128 forward: _attn_fwd_hopper_ws: 12 warps")
               for line in lines), proc.stdout
    # FP8 at head dim 256: the q.k product promoted to fp32 every 128 (the Gluon forward's two slices,
    # the portable forward's max_num_imprecise_acc) lowers on both kernels
    for line in ("ok hopper_ws fp8 e4m3 causal hd256, promoted q.k forward: _attn_fwd_hopper_ws: 12 warps",
                 "ok fp8 e4m3 gqa causal hd256, promoted q.k, TMA + warp specialization forward: _attn_fwd: 8 warps"):
        assert any(entry.startswith(line) for entry in lines), (line, proc.stdout)
    # the Gluon forward with mask patterns (documents' searches, per-batch prefix lengths, floor
    # division; two consumers, ping-pong, one consumer with overlap): the masked call takes it
    # (documents: after the kernel that fills its block-range table, as the Gluon dK/dV's)
    for case, warps in (("documents gqa, 2 consumers", 12), ("prefix-LM lengths, ping-pong", 12),
                        ("chunks and window hd64, 1 consumer, overlap", 8)):
        head, kernels = f"ok hopper_ws masked {case} forward: ", [f"_attn_fwd_hopper_ws: {warps} warps"]
        kernels += ["_hw_fwd_ranges: 4 warps"] if case.startswith("documents") else []
        assert any(entry.startswith(head) and all(k in entry for k in kernels) for entry in lines), (head, proc.stdout)
    # a documents training step on the persistent Gluon forward: its range kernel (FILL_RUNS) fills the runs table
    # the portable backward kernels read
    head = "ok hopper_ws persistent masked documents gqa, overlap, TMA store training step: "
    assert any(entry.startswith(head) and all(k in entry for k in ("_hw_fwd_ranges: 4 warps", "_attn_fwd_hopper_ws",
                                                                   "_attn_bwd_dkdv", "_attn_bwd_dq"))
               for entry in lines), proc.stdout
    assert any(entry.startswith("ok hopper_bwd masked documents gqa hd128 backward: ") and "_hw_bwd_ranges: 4 warps" in entry
               and "_attn_bwd_dkdv_hopper: 12 warps" in entry for entry in lines), proc.stdout
