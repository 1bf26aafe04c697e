"""sm90_bwd's head-dim-128 main-loop flags on an H100, forced with bwd_config= (issue 14, the d128
backward at cuDNN's speed):

* dq_early (kDqEarly): the dQ GEMM issued behind dV, dK without waiting for them; one wait for the
  three before the dQ part is stored and the Q/dO slot released;
* dk_late (kDkLate, with dq_early; with the dynamic scheduler at d128 only with frag_pin): dK issued
  behind the dQ GEMM (FlashAttention-3's order), waited for after the dQ part is staged;
* frag_pin (kFragPin, session 16): Pᵀ's A fragments pinned at the wgmma fence (dV's k16 steps one
  group); the heuristic's at d128 with dk_late and the dynamic scheduler;
* BM 80 (kDqSwap, session 16, bf16 non-causal d128, off): the dQ part transposed, dQ_iᵀ = K_jᵀ dSᵀ;
* q_rotate (kQRotate, non-causal): K/V block n visits the Q blocks from n % n_iters on, wrapping;
* (s_ahead, kSAhead: refused since session 17, ptxas serializes its wgmmas (C7515); not tested.)

Each on the heuristic's kernel (non-causal: the plain grid; causal: the dynamic scheduler), on the
odd shapes of test_sm90_bwd_gpu.py (seqlens 1, 17, 113, 1023, 2049, s_q != s_k both ways; MHA /
GQA / MQA in turn); fp16 with dq_early and two dS buffers (causal, dynamic); many tiles per CTA
(2 x 8 heads x 33 K/V blocks, GQA: Sᵀ-ahead never crosses a tile, the ring's phases across tiles);
a deterministic dq_early call (ordered red.add; bitwise reproducible over 3 calls). Errors: the 3x
gradient rule against float64, outputs poisoned (NaN) before each launch.

Session 16 adds: d64 dq_early + dk_late on odd shapes (bf16 / fp16), frag_pin (d128 bf16, d64 fp16
with dk_late, d128 dk_late with the dynamic scheduler; 528 tiles; deterministic bitwise), BM 80, fp16
d128 stages 3 and fp16 d64 q_rotate on the heuristic's kernel.

Compiles: about 30 backward kernels and their forwards (tests/sm90_bwd_d128_precompile.py first; --pin
for session 16's tests only).

Run first: CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_sm90_bwd_d128_gpu.py
"""
import math

import pytest

import cuflash
from cuflash import registry

from test_flash_bwd_gpu import check_grads, grads, inputs, reference_grads  # noqa: E402
from test_sm90_bwd_gpu import HEADS, heuristic, problem, run_case  # noqa: E402
from sm90_bwd_d128_timing import old  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_bwd")
SHAPES = [(1, 1), (17, 17), (113, 113), (1023, 1023), (2049, 2049), (113, 301), (301, 113)]
FLAGS = {"dqe": dict(dq_early=True)}   # (s_ahead left: refused, its kernels serialized by ptxas)
ROTATE = {"rot": dict(q_rotate=True), "dqe_rot": dict(q_rotate=True, dq_early=True),
          "rot_dyn": dict(q_rotate=True, dynamic=True)}


def with_flags(p, **flags):
    """The session-14 heuristic's config of the call class (sm90_bwd_d128_timing.old: one dS buffer,
    the dynamic scheduler under the causal mask) with `flags`, as the call runs it."""
    cfg = FAM.for_problem(old(heuristic(p)).replace(**flags), p)
    assert all(getattr(cfg, k) == v for k, v in flags.items()) and cfg.problems() == [], cfg.name
    return cfg


@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("flag", list(FLAGS))
def test_odd_seqlens(flag, causal, seqlens):
    heads = list(HEADS)[SHAPES.index(seqlens) % len(HEADS)]   # MHA, GQA, MQA in turn
    p = problem("bf16", causal, 128, seqlens, heads)
    cfg = with_flags(p, **FLAGS[flag])
    assert cfg.dynamic == causal          # the session-14 heuristic's scheduler
    run_case(p, cfg)


@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("flags", list(ROTATE))
def test_q_rotate_odd_seqlens(flags, seqlens):
    """Non-causal: K/V block n from Q block n % n_iters on (one Q block: no rotation; s_q < s_k:
    more K/V blocks than Q blocks, the modulo wraps), the plain grid and the dynamic scheduler."""
    heads = list(HEADS)[SHAPES.index(seqlens) % len(HEADS)]
    p = problem("bf16", False, 128, seqlens, heads)
    run_case(p, with_flags(p, **ROTATE[flags]))


@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dk_late_odd_seqlens(causal, seqlens):
    """dk_late (with dq_early and two dS buffers, on the plain grid: the heuristic's d128 kernel):
    dK issued behind the dQ GEMM, waited for after the dQ part is staged, then the Q/dO slot
    released."""
    heads = list(HEADS)[SHAPES.index(seqlens) % len(HEADS)]
    p = problem("bf16", causal, 128, seqlens, heads)
    run_case(p, with_flags(p, dynamic=False, lpt=False, ds_double=True, dq_early=True, dk_late=True))


@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_d64_dk_late_odd_seqlens(dtype, causal, seqlens):
    """Head dim 64 (the BM128 BN128 dynamic tile) with dq_early + dk_late: measured 0.5-6.6% faster
    than its heuristic (session 15 round B), not its default yet; this is the check before it is."""
    heads = list(HEADS)[SHAPES.index(seqlens) % len(HEADS)]
    p = problem(dtype, causal, 64, seqlens, heads)
    cfg = FAM.for_problem(heuristic(p).replace(dq_early=True, dk_late=True), p)
    assert cfg.dynamic and cfg.dq_early and cfg.dk_late and cfg.problems() == [], cfg.name
    run_case(p, cfg)


@pytest.mark.parametrize("seqlens", [(113, 301), (2049, 2049)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_fp16_dq_early_ds_double(seqlens):
    p = problem("fp16", True, 128, seqlens, "gqa")
    run_case(p, with_flags(p, dq_early=True, ds_double=True))


@pytest.mark.parametrize("flag", list(FLAGS) + ["rot_dyn"])
def test_many_tiles_per_cta(flag):
    """2 x 8 heads x 33 K/V blocks (s 4097: a ragged last block) = 528 tiles over 132 CTAs of the
    dynamic scheduler (causal; rot_dyn: non-causal, rotated)."""
    from cuflash.problem import Problem

    flags = ROTATE.get(flag) or FLAGS[flag]
    p = Problem("bwd", "bf16", 2, 4097, 4097, 8, 2, 128, "rot" not in flag)
    run_case(p, with_flags(p, **flags))


def test_heuristic_is_dk_late():
    """The heuristic's d128 kernel (HEURISTIC_DK_LATE, HEURISTIC_FRAG_PIN, HEURISTIC_DYNAMIC): dq_early +
    dk_late + ds_double + frag_pin with the dynamic scheduler (tests/test_sm90_bwd_gpu.py runs it on its
    grid)."""
    for causal in (False, True):
        p = problem("bf16", causal, 128, (1023, 1100), "gqa")
        cfg = heuristic(p)
        assert cfg.dq_early and cfg.dk_late and cfg.ds_double and cfg.dynamic and cfg.frag_pin, cfg.name
        run_case(p, cfg)


def test_dq_early_deterministic_bitwise():
    import torch

    p = problem("bf16", True, 128, (1023, 1100), "gqa", deterministic=True)
    cfg = with_flags(p, dq_early=True)
    assert cfg.deterministic and not cfg.dq_writer
    q, k, v, dout = inputs(p)
    first = None
    for _ in range(3):
        _, g = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                                             bwd_config=cfg), q, k, v, dout)
        if first is None:
            first = g
            ref, low = reference_grads(q, k, v, dout, True, 1 / math.sqrt(128))
            check_grads(g, ref, low)
        else:
            for a, b in zip(first, g):
                assert torch.equal(a, b), "deterministic backward differs between runs"


# frag_pin (kFragPin: Pᵀ's A fragments pinned at the wgmma fence, dV's k16 steps one group): on the
# heuristic's d128 kernel (bf16) and on d64's dq_early + dk_late tile (fp16), both masks
PIN = {"d128_bf16": (128, "bf16", {}), "d64_fp16_dkl": (64, "fp16", dict(dq_early=True, dk_late=True)),
       "d128_bf16_dyn": (128, "bf16", dict(dynamic=True)),   # (dk_late with the dynamic scheduler)
       "d128_fp16_plain": (128, "fp16", dict(dynamic=False))}   # (the heuristic's fp16 causal kernel above 4k)


@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(PIN))
def test_frag_pin_odd_seqlens(case, causal, seqlens):
    hdim, dtype, flags = PIN[case]
    heads = list(HEADS)[SHAPES.index(seqlens) % len(HEADS)]
    p = problem(dtype, causal, hdim, seqlens, heads)
    cfg = FAM.for_problem(heuristic(p).replace(frag_pin=True, **flags), p)
    assert cfg.frag_pin and all(getattr(cfg, k) == v for k, v in flags.items()) and cfg.problems() == [], cfg.name
    run_case(p, cfg)


def test_frag_pin_dynamic_many_tiles():
    """d128 dk_late with the dynamic scheduler (fits with frag_pin): 2 x 8 heads x 33 K/V blocks (s 4097,
    GQA) = 528 tiles over the SMs' CTAs, causal: the ring's phases and dq_writer's tiles across tiles."""
    from cuflash.problem import Problem

    p = Problem("bwd", "bf16", 2, 4097, 4097, 8, 2, 128, True)
    cfg = FAM.for_problem(heuristic(p).replace(dynamic=True, frag_pin=True), p)
    assert cfg.dynamic and cfg.dk_late and cfg.frag_pin and cfg.problems() == [], cfg.name
    run_case(p, cfg)


def test_frag_pin_deterministic_bitwise():
    """frag_pin on a deterministic d128 causal call (ordered red.add): bitwise equal over 3 calls."""
    import torch

    p = problem("bf16", True, 128, (1023, 1100), "gqa", deterministic=True)
    cfg = FAM.for_problem(heuristic(p).replace(frag_pin=True), p)
    assert cfg.deterministic and cfg.frag_pin and cfg.problems() == [], cfg.name
    q, k, v, dout = inputs(p)
    first = None
    for _ in range(3):
        _, g = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                                             bwd_config=cfg), q, k, v, dout)
        if first is None:
            first = g
            ref, low = reference_grads(q, k, v, dout, True, 1 / math.sqrt(128))
            check_grads(g, ref, low)
        else:
            for a, b in zip(first, g):
                assert torch.equal(a, b), "deterministic backward differs between runs"


@pytest.mark.parametrize("seqlens", SHAPES + [(1023, 2049)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", ["bf16"])
def test_bm80_odd_seqlens(dtype, seqlens):
    """BM 80 (non-causal d128, FA3's tile there): the dQ part transposed (dQ_iᵀ = K_jᵀ dSᵀ, m64n80k16
    with A transposed), staged transposed for the writer warp; Q blocks of 80 rows, so the last one
    may end past the workspace's padded rows (1023: 13 x 80 = 1040 > 1024; 113: 160 > 128), where the
    producer zero-fills LSE and D."""
    heads = list(HEADS)[(SHAPES + [(1023, 2049)]).index(seqlens) % len(HEADS)]
    p = problem(dtype, False, 128, seqlens, heads)
    cfg = FAM.for_problem(heuristic(p).replace(BM=80, frag_pin=False, dynamic=False), p)
    assert cfg.BM == 80 and cfg.problems() == [], cfg.name
    run_case(p, cfg)


@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("case", ["d128_fp16_s3", "d64_fp16_rot"])
def test_s3_and_d64_rot_odd_seqlens(case, seqlens):
    """Non-causal: the heuristic's d128 kernel at stages 3 (one dq_writer staging tile then), fp16; d64's
    heuristic kernel (dq_early + dk_late, dynamic) with q_rotate, fp16."""
    heads = list(HEADS)[SHAPES.index(seqlens) % len(HEADS)]
    hdim, flags = (128, dict(stages=3)) if case == "d128_fp16_s3" else (64, dict(q_rotate=True))
    p = problem("fp16", False, hdim, seqlens, heads)
    cfg = FAM.for_problem(heuristic(p).replace(**flags), p)
    assert all(getattr(cfg, k) == v for k, v in flags.items()) and cfg.dk_late and cfg.problems() == [], cfg.name
    run_case(p, cfg)
