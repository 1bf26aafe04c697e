"""sm90_bwd with dq_bulk (dQ_i parts through a shared-memory staging tile, one
cp.reduce.async.bulk add per row) on an H100, forced with bwd_config=.

The heuristic's config of each call class with dq_bulk=True, on the odd shapes of
test_sm90_bwd_gpu.py (seqlens 1, 17, 113, 1023, 2049, s_q != s_k both ways, MHA / GQA / MQA),
causal and not, head dims 64 and 128 (and a smaller real head dim), bf16 and fp16; then with the
feature flags (window + softcap + ALiBi; dropout at d64) through test_sm90_bwd_features_gpu.py's checks.
Errors: the 3x gradient rule against float64, outputs poisoned (NaN) before each launch. A
deterministic call drops dq_bulk (for_problem) and stays bitwise reproducible.

Compiles: 9 backward kernels (d64 / d128 x causal / not, d128 fp16, d128 all features x causal
/ not, d64 dropout, the deterministic one) and their forwards.

Run first: CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_sm90_bwd_dqbulk_gpu.py
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


def bulk(p):
    cfg = heuristic(p).replace(dq_bulk=True, dq_writer=False)
    assert cfg.problems() == [] and cfg.name.endswith("_dqb"), cfg.name
    return cfg


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", [64, 128])
def test_odd_seqlens(hdim, causal, seqlens):
    heads = list(HEADS)[SEQLENS.index(seqlens) % len(HEADS)]   # MHA, GQA, MQA in turn
    p = problem("bf16", causal, hdim, seqlens, heads)
    run_case(p, bulk(p))


@pytest.mark.parametrize("heads", ["gqa", "mqa"])
def test_fp16_gqa_mqa_and_smaller_head_dim(heads):
    for hdim in (128, 120):   # 120: the d128 kernel, TMA zero-fills the missing columns
        p = problem("fp16", True, hdim, (300, 333), heads)
        run_case(p, bulk(p))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_all_features(monkeypatch, causal):
    """window + softcap + ALiBi with dq_bulk (the d128 kernel; test_sm90_bwd_features_gpu's
    shapes and 3x rule)."""
    base = feat.sm90_config
    monkeypatch.setattr(feat, "sm90_config", lambda *a, **kw: base(*a, **kw).replace(dq_bulk=True, dq_writer=False))
    feat.check_case("bf16", 128, causal, (129, -1) if causal else (50, 20), 10.0, "bh")


def test_dropout(monkeypatch):
    """dropout with dq_bulk at d64 (at d128 the dQ path is Sm90BwdConfig.dropout_dq_path's:
    dq_bulk only with softcap / ALiBi, test_dropmix_gpu.py runs those)."""
    base = feat.sm90_config
    monkeypatch.setattr(feat, "sm90_config", lambda *a, **kw: base(*a, **kw).replace(dq_bulk=True, dq_writer=False))
    feat.test_dropout(64, True, False)


def test_deterministic_call_drops_dq_bulk():
    """A forced dq_bulk config on a deterministic call runs the ordered red.add kernel: right and
    bitwise reproducible."""
    import torch

    from test_flash_bwd_gpu import check_grads, reference_grads

    p = problem("bf16", True, 128, (1023, 1100), "gqa", deterministic=True)
    cfg = heuristic(p.replace(deterministic=False)).replace(dq_bulk=True, dq_writer=False)
    assert not FAM.for_problem(cfg, p).dq_bulk and FAM.for_problem(cfg, p).deterministic
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
