"""sm90_bwd's dq_convert (kDqConvert, session 17) on an H100, forced with bwd_config=: the dQ convert
inside the main kernel (Sm90BwdDqQueue in kernels_cu/sm90_bwd.cu: the writer warp counts each tile once
its bulk reduce-adds have completed, a (head, batch) pair's last tile queues its 256-row jobs, CTAs whose
tiles are done convert them), no fa2_bwd_convert_dq launch.

* head dim 128 (the dynamic scheduler, the heuristic's kernel + dq_convert), bf16 non-causal and fp16
  causal, and head dim 256 with roles (the plain grid: each CTA drains the queue at its end), bf16
  causal and fp16 non-causal, on odd shapes: seqlens 1, 17, 113, 1023, 2049 and s_q != s_k both ways
  (a ragged last job of 256 rows; more K/V blocks than Q blocks and the reverse), MHA / GQA / MQA in
  turn; head dim 192 (the d256 kernel, zero-filled columns) once;
* many tiles per CTA (2 x 8 heads x 33 K/V blocks = 528 tiles on 132 CTAs), the same plan called 3 times
  in a row: the counters (tile claims, per-pair counts, the queue's head, tail and slots) must be back
  to 0 after each launch, or a later call converts nothing (its dQ stays NaN: outputs are poisoned)
  or converts too early; dk, dv equal bit for bit to the heuristic kernel's (dq_convert changes where
  dQ is converted only), dq within the 3x rule;
* deterministic=True calls drop dq_convert (for_problem) and stay bitwise reproducible.

Errors: the 3x gradient rule against float64, outputs poisoned (NaN) before each launch. Compiles: 5
backward kernels with dq_convert, 1 without, and their forwards.

Run first: CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_sm90_bwd_dqconv_gpu.py
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
# (kernel head dim, dtype, causal): the classes of dq_convert's kernels here
CLASSES = [(128, "bf16", False), (128, "fp16", True), (256, "bf16", True), (256, "fp16", False)]


def with_dq_convert(p):
    cfg = FAM.for_problem(heuristic(p).replace(dq_convert=True), p)
    assert cfg.dq_convert and cfg.problems() == [], cfg.name
    assert "convert_dq" not in {s.role for s in FAM.launches(cfg, p, 132)}
    return cfg


@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("d,dtype,causal", CLASSES, ids=lambda x: str(x))
def test_odd_seqlens(d, dtype, causal, seqlens):
    heads = list(HEADS)[SHAPES.index(seqlens) % len(HEADS)]   # MHA, GQA, MQA in turn
    p = problem(dtype, causal, d, seqlens, heads)
    cfg = with_dq_convert(p)
    assert cfg.dynamic == (d == 128) and cfg.roles == (d == 256)
    run_case(p, cfg)


def test_head_dim_192():
    p = problem("bf16", True, 192, (1023, 1100), "gqa")
    run_case(p, with_dq_convert(p))


@pytest.mark.parametrize("d", [128, 256])
def test_many_tiles_repeated_calls(d):
    """528 tiles (d128: the dynamic scheduler's 132 CTAs claim 4 each; d256: 2 x 8 heads x 65 K/V
    blocks of 64 keys, 1040 CTAs of the plain grid); 3 calls of one plan: each converts every row."""
    p = Problem("bwd", "bf16", 2, 4097, 4097, 8, 2, d, True)
    cfg = with_dq_convert(p)
    base = FAM.for_problem(heuristic(p), p)
    assert not base.dq_convert
    q, k, v, dout = inputs(p)
    ref, low = reference_grads(q, k, v, dout, True, 1 / math.sqrt(d))
    _, want = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True, bwd_config=base), q, k, v, dout)
    for call in range(3):
        _, got = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True, bwd_config=cfg),
                       q, k, v, dout)
        check_grads(got, ref, low, what=f"{cfg.name} call {call} ")
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), f"call {call}: dk / dv differ"


def test_deterministic_drops_it():
    p = problem("bf16", False, 128, (1023, 1100), "gqa", deterministic=True)
    cfg = FAM.for_problem(heuristic(p).replace(dq_convert=True), p)
    assert not cfg.dq_convert and cfg.problems() == []
    q, k, v, dout = inputs(p)
    outs = [grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, deterministic=True, bwd_config=cfg),
                  q, k, v, dout)[1] for _ in range(3)]
    assert all(torch.equal(a, b) for o in outs[1:] for a, b in zip(o, outs[0]))
