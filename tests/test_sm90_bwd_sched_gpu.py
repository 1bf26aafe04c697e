"""sm90_bwd's schedule flags on an H100, forced with bwd_config= (issue 14):

* overlap_sdp: dPᵀ issued right behind Sᵀ, Pᵀ computed while it runs;
* dq_writer: dQ_i staged in shared memory, added by a producer warp's tensor bulk reduce-adds.

Each flag alone and both together on the odd shapes of test_sm90_bwd_gpu.py (seqlens 1, 17, 113,
1023, 2049, s_q != s_k both ways; MHA / GQA / MQA in turn), causal and not, head dims 64 and
128; fp16 with GQA / MQA and a smaller real head dim; dq_writer's single-tile kernel (stages 3);
window + softcap + ALiBi with dq_writer, a window with overlap_sdp, dropout at d64 with both; a
deterministic call (drops dq_writer, stays bitwise reproducible). Errors: the 3x gradient rule
against float64, outputs poisoned (NaN) before each launch.

Compiles: 19 backward kernels and their forwards.

Run first: CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_sm90_bwd_sched_gpu.py
"""
import math

import pytest

import cuflash
from cuflash import registry

import test_sm90_bwd_features_gpu as feat  # noqa: E402
from test_flash_bwd_gpu import grads, inputs  # noqa: E402
from test_sm90_bwd_gpu import HEADS, SEQLENS, heuristic, problem, run_case  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_bwd")
FLAGS = {"ovl": dict(overlap_sdp=True), "dqw": dict(dq_writer=True),
         "both": dict(overlap_sdp=True, dq_writer=True)}
# each flag alone on a few of the odd shapes, both together on all of them
SHORT = [(1, 1), (113, 113), (2049, 2049), (113, 301), (301, 113)]


def forced(p, flags):
    """The heuristic's config of the call class with `flags`, as the call will run it."""
    cfg = FAM.for_problem(heuristic(p).replace(**FLAGS[flags]), p)
    assert all(getattr(cfg, k) for k in FLAGS[flags]) and cfg.problems() == [], cfg.name
    return cfg


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", [64, 128])
@pytest.mark.parametrize("flags", list(FLAGS))
def test_odd_seqlens(flags, hdim, causal, seqlens):
    if flags != "both" and seqlens not in SHORT:
        pytest.skip("each flag alone: a few of the shapes")
    heads = list(HEADS)[SEQLENS.index(seqlens) % len(HEADS)]   # MHA, GQA, MQA in turn
    p = problem("bf16", causal, hdim, seqlens, heads)
    run_case(p, forced(p, flags))


@pytest.mark.parametrize("heads", ["gqa", "mqa"])
def test_fp16_gqa_mqa_and_smaller_head_dim(heads):
    for hdim in (128, 120):   # 120: the d128 kernel, TMA zero-fills the missing columns
        p = problem("fp16", False, hdim, (300, 333), heads)
        run_case(p, forced(p, "both"))


def test_dq_writer_single_tile():
    """stages 3 at d128: one staging tile (no room for two), the consumers wait for the writer's
    read before every Q block."""
    p = problem("bf16", True, 128, (1023, 1100), "gqa")
    cfg = forced(p, "dqw").replace(stages=3)
    assert cfg.dq_writer_bufs == 1 and cfg.problems() == []
    run_case(p, cfg)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_all_features_with_dq_writer(monkeypatch, causal):
    """window + softcap + ALiBi with dq_writer (the d128 kernel; test_sm90_bwd_features_gpu's
    shapes and 3x rule)."""
    base = feat.sm90_config
    monkeypatch.setattr(feat, "sm90_config", lambda *a, **kw: base(*a, **kw).replace(dq_writer=True))
    feat.check_case("bf16", 128, causal, (129, -1) if causal else (50, 20), 10.0, "bh")


def test_window_with_overlap_sdp(monkeypatch):
    """A window with overlap_sdp (and dq_writer) at d128, non-causal (the allowed combination)."""
    base = feat.sm90_config
    monkeypatch.setattr(feat, "sm90_config",
                        lambda *a, **kw: base(*a, **kw).replace(overlap_sdp=True, dq_writer=True))
    feat.check_case("bf16", 128, False, (50, 20), 0.0, None)


def test_dropout_d64_with_both(monkeypatch):
    """dropout with both flags at d64 (at d128 overlap_sdp with dropout spills: refused, and
    for_problem drops it; dq_writer is d128 dropout's dQ path, test_sm90_bwd_features_gpu.py)."""
    base = feat.sm90_config
    monkeypatch.setattr(feat, "sm90_config",
                        lambda *a, **kw: base(*a, **kw).replace(overlap_sdp=True, dq_writer=True))
    feat.test_dropout(64, True, False)


def test_deterministic_call_drops_dq_writer():
    """A forced dq_writer + overlap_sdp config on a deterministic call runs the ordered red.add
    additions (overlap_sdp stays): right and bitwise reproducible."""
    import torch

    from test_flash_bwd_gpu import check_grads, reference_grads

    p = problem("bf16", False, 128, (1023, 1100), "gqa", deterministic=True)
    cfg = heuristic(p.replace(deterministic=False)).replace(overlap_sdp=True, dq_writer=True)
    run = FAM.for_problem(cfg, p)
    assert run.deterministic and not run.dq_writer and run.overlap_sdp
    q, k, v, dout = inputs(p)
    first = None
    for _ in range(3):
        _, g = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, deterministic=True, bwd_config=cfg),
                     q, k, v, dout)
        if first is None:
            first = g
            ref, low = reference_grads(q, k, v, dout, False, 1 / math.sqrt(128))
            check_grads(g, ref, low)
        else:
            for a, b in zip(first, g):
                assert torch.equal(a, b), "deterministic backward differs between runs"
