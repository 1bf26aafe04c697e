"""sm90_bwd's dq_first (kDqFirst, session 18) on an H100, forced with bwd_config=: the preprocess leaves
the fp32 dQ accumulator unzeroed (fa2_bwd_preprocess<Elem, false, false>), and the first CTA to reach a Q
block zeroes its rows in the main kernel (producer warp 2; the Q block's ticket in dq_semaphore taken 0 -> 1,
published 2 once the zeros are fenced; the writers wait for 2 before their reduce-adds).

* every tile kind that has the writer warp: head dim 128 (the dynamic scheduler; with dq_convert for fp16
  causal), 256 with roles (the plain grid, dQ staged in the ring slot), 64 (the BM 128 dynamic tile), bf16
  and fp16, causal or not, on odd shapes: seqlens 1, 17, 113, 1023, 2049 and s_q != s_k both ways, MHA /
  GQA / MQA in turn. Causal with s_q > s_k drops dq_first (for_problem: its first query rows get no dQ
  part), and the call stays right;
* many tiles per CTA, the same plan called 3 times in a row (the tickets must be zeroed by each call's
  preprocess; the accumulator keeps the last call's sums, which an unzeroed Q block would add to): dk, dv
  equal bit for bit to the kernel without dq_first (dQ's path only changes), dq within the 3x rule;
* a dout with a non-contiguous head dim (the preprocess's dout copy, without the zeroing).

Errors: the 3x gradient rule against float64, outputs poisoned (NaN) before each launch.

Run first: CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_sm90_bwd_dqfirst_gpu.py
"""
import math

import pytest
import torch

import cuflash
from cuflash import registry
from cuflash.problem import Problem

from test_flash_bwd_gpu import check_grads, grads, inputs, reference_grads  # noqa: E402
from test_sm90_bwd_gpu import HEADS, heuristic, problem, run_case  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_bwd")
SHAPES = [(1, 1), (17, 17), (113, 113), (1023, 1023), (2049, 2049), (113, 301), (301, 113)]
# (kernel head dim, dtype, causal)
# (session 19: fp16 d128 non-causal, the heuristic's without dq_convert, fp16 d256 causal and fp16 d64
# non-causal, with q_rotate, joined)
CLASSES = [(128, "bf16", False), (128, "fp16", True), (256, "bf16", True), (256, "fp16", False), (64, "bf16", True),
           (128, "fp16", False), (256, "fp16", True), (64, "fp16", False)]


def with_dq_first(p):
    cfg = FAM.for_problem(heuristic(p).replace(dq_first=True), p)
    assert cfg.problems() == [], cfg.name
    assert cfg.dq_first == (not p.causal or p.seqlen_q <= p.seqlen_k), cfg.name
    return cfg


@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("d,dtype,causal", CLASSES, ids=lambda x: str(x))
def test_odd_seqlens(d, dtype, causal, seqlens):
    heads = list(HEADS)[SHAPES.index(seqlens) % len(HEADS)]   # MHA, GQA, MQA in turn
    run_case(*(lambda p: (p, with_dq_first(p)))(problem(dtype, causal, d, seqlens, heads)))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_many_tiles_repeated_calls(d):
    """2 x 8 heads x 4097 (d128: 33 K/V blocks a pair, 528 tiles on 132 CTAs; d256 1040 CTAs of the
    plain grid), non-causal (every K/V block of a pair reaches Q block 0 at once: the tickets are
    contended); 3 calls of one plan."""
    p = Problem("bwd", "bf16", 2, 4097, 4097, 8, 2, d, False)
    cfg = with_dq_first(p)
    base = FAM.for_problem(heuristic(p).replace(dq_first=False), p)
    assert not base.dq_first
    q, k, v, dout = inputs(p)
    ref, low = reference_grads(q, k, v, dout, False, 1 / math.sqrt(d))
    _, want = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=base), q, k, v, dout)
    for call in range(3):
        _, got = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=cfg), q, k, v, dout)
        check_grads(got, ref, low, what=f"{cfg.name} call {call} ")
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), f"call {call}: dk / dv differ"


def test_dout_copy():
    p = problem("bf16", True, 128, (257, 257), "gqa")
    cfg = with_dq_first(p)
    q, k, v, dout = inputs(p)
    dout_t = dout.transpose(-1, -2).contiguous().transpose(-1, -2)   # head dim stride != 1
    _, ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True, bwd_config=cfg),
                    q, k, v, dout_t)
    ref, low = reference_grads(q, k, v, dout, True, 1 / math.sqrt(128))
    check_grads(ours, ref, low, what=f"{cfg.name} dout copy ")
