"""sm90_bwd's head-dim-64 tiles with two consumer warpgroups on an H100, forced with bwd_config=
(issue 14; tests/test_sm90_bwd_d64_cpu.py has their rules and ptxas checks):

* HALVES  BM64 BN128 c2: dQ_i split by head-dim halves, 32 columns per warpgroup (wgmma
  m64n32k16 with K_j's B operand starting 64 bytes into its 128-byte swizzled rows: the first
  thing to suspect if only this tile's dq is wrong, sm90_bwd.cu k_t_desc);
* FA3     BM128 BN128 c2: dQ_i split by rows, 64 per warpgroup.

Every dQ path (red.add, dq_bulk, dq_writer, ordered red.add when deterministic) and the schedule
flag overlap_sdp, on the odd shapes of test_sm90_bwd_gpu.py (seqlens 1, 17, 113, 1023, 2049,
s_q != s_k both ways, MHA / GQA / MQA in turn), causal and not; fp16 with GQA / MQA and a
smaller real head dim (40, TMA zero-fills); stages 3 (FA3: one dq_writer staging tile);
deterministic bitwise over 3 runs; each feature flag once (window, softcap, ALiBi, all three,
dropout on HALVES; a window on FA3, the only feature its kernel takes). Errors: the 3x gradient
rule against float64, outputs poisoned (NaN) before each launch.

Compiles: 22 backward kernels and their forwards.

Run first: CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_sm90_bwd_d64_gpu.py
"""
import math
import os
import sys

if __name__ == "__main__":   # --precompile: cuflash and the tests' helpers from this checkout
    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import pytest  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry  # noqa: E402
from cuflash.families.sm90_bwd import Sm90BwdConfig  # noqa: E402

import test_sm90_bwd_features_gpu as feat  # noqa: E402
from test_flash_bwd_gpu import check_grads, grads, inputs, reference_grads  # noqa: E402
from test_sm90_bwd_gpu import HEADS, SEQLENS, problem, run_case  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_bwd")
TILES = {"halves": (64, 128), "fa3": (128, 128)}   # (BM, BN), 2 consumers each
SHORT = [(113, 113), (2049, 2049), (301, 113)]


def tile(name, p, **flags):
    """The tile `name` for problem p with `flags`, as the call will run it (for_problem must keep
    the tile and the flags)."""
    import torch

    if tuple(torch.cuda.get_device_capability()) != (9, 0):
        pytest.skip("sm_90 only")
    BM, BN = TILES[name]
    cfg = Sm90BwdConfig(BM, BN, flags.pop("stages", 2), 2, 64, p.dtype, p.causal, p.deterministic, **flags)
    run = FAM.for_problem(cfg, p)
    assert run == cfg and run.problems() == [], (run.name, run.problems())
    return cfg


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(TILES))
def test_odd_seqlens_dq_writer(name, causal, seqlens):
    heads = list(HEADS)[SEQLENS.index(seqlens) % len(HEADS)]   # MHA, GQA, MQA in turn
    p = problem("bf16", causal, 64, seqlens, heads)
    run_case(p, tile(name, p, dq_writer=True))


@pytest.mark.parametrize("path", ["red_add", "dq_bulk", "ovl_dqw"])
@pytest.mark.parametrize("name", list(TILES))
def test_dq_paths(name, path):
    flags = {"red_add": {}, "dq_bulk": dict(dq_bulk=True),
             "ovl_dqw": dict(overlap_sdp=True, dq_writer=True)}[path]
    for i, seqlens in enumerate(SHORT):
        p = problem("bf16", True, 64, seqlens, list(HEADS)[i % len(HEADS)])
        run_case(p, tile(name, p, **flags))


@pytest.mark.parametrize("name", list(TILES))
def test_fp16_gqa_mqa_and_smaller_head_dim(name):
    for heads in ("gqa", "mqa"):
        for hdim in (64, 40):   # 40: the d64 kernel, TMA zero-fills the missing columns
            p = problem("fp16", False, hdim, (300, 333), heads)
            cfg = tile(name, p.replace(head_dim=64), dq_writer=True)
            run_case(p, cfg)


def test_fa3_stages_3_single_staging_tile():
    p = problem("bf16", True, 64, (1023, 1100), "gqa")
    cfg = tile("fa3", p, dq_writer=True, stages=3)
    assert cfg.dq_writer_bufs == 1
    run_case(p, cfg)


@pytest.mark.parametrize("name", list(TILES))
def test_deterministic_bitwise(name):
    import torch

    p = problem("bf16", True, 64, (1023, 1100), "gqa", deterministic=True)
    cfg = tile(name, p)
    q, k, v, dout = inputs(p)
    first = None
    for _ in range(3):
        _, g = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                                             bwd_config=cfg), q, k, v, dout)
        if first is None:
            first = g
            ref, low = reference_grads(q, k, v, dout, True, 1 / math.sqrt(64))
            check_grads(g, ref, low, what=f"{cfg.name} ")
        else:
            for a, b in zip(first, g):
                assert torch.equal(a, b), f"{cfg.name}: deterministic backward differs between runs"


def _force(monkeypatch, name, **flags):
    """test_sm90_bwd_features_gpu's cases with tile `name` (dq_writer, the heuristic's dQ path)."""
    BM, BN = TILES[name]

    def config(dtype, d, causal, deterministic=False):
        assert d == 64
        return Sm90BwdConfig(BM, BN, 2, 2, 64, dtype, causal, deterministic,
                             dq_writer=not deterministic, **flags)

    monkeypatch.setattr(feat, "sm90_config", config)


@pytest.mark.parametrize("name,causal", [("halves", False), ("halves", True), ("fa3", True)])
def test_window(monkeypatch, name, causal):
    _force(monkeypatch, name)
    for window in feat.WINDOWS:
        if causal and window[0] < 0:
            continue
        feat.check_case("bf16", 64, causal, window, 0.0, None, feat.SHAPES[2:5])


def test_softcap(monkeypatch):
    _force(monkeypatch, "halves")
    feat.check_case("bf16", 64, True, (-1, -1), 5.0, None)


def test_alibi(monkeypatch):
    _force(monkeypatch, "halves")
    feat.check_case("bf16", 64, False, (-1, -1), 0.0, "bh")


def test_all_features(monkeypatch):
    _force(monkeypatch, "halves")
    feat.check_case("bf16", 64, False, (50, 20), 10.0, "h")


def test_dropout(monkeypatch):
    _force(monkeypatch, "halves")
    feat.test_dropout(64, True, False)


def suite_configs():
    """The backward kernels this file runs (as the calls run them), for --precompile."""
    out = []
    for name, (BM, BN) in TILES.items():
        for dtype, causal, det in (("bf16", False, False), ("bf16", True, False), ("fp16", False, False),
                                   ("bf16", True, True)):
            base = Sm90BwdConfig(BM, BN, 2, 2, 64, dtype, causal, det)
            out += [base] if det else [base.replace(dq_writer=True)]
        causal = Sm90BwdConfig(BM, BN, 2, 2, 64, "bf16", True)
        out += [causal, causal.replace(dq_bulk=True), causal.replace(overlap_sdp=True, dq_writer=True),
                causal.replace(window=True, dq_writer=True)]
    halves = Sm90BwdConfig(64, 128, 2, 2, 64, "bf16", False, dq_writer=True)
    out += [Sm90BwdConfig(128, 128, 3, 2, 64, "bf16", True, dq_writer=True),
            halves.replace(window=True), halves.replace(causal=True, softcap=True), halves.replace(alibi=True),
            halves.replace(window=True, softcap=True, alibi=True), halves.replace(causal=True, dropout=True)]
    return list(dict.fromkeys(out))


if __name__ == "__main__" and "--precompile" in sys.argv:   # [--space]
    import time

    from cuflash.compile import precompile

    t0 = time.time()
    configs = suite_configs()
    if "--space" in sys.argv:   # also test_sm90_bwd_gpu.py's every-point-of-the-space kernels at d64
        from test_sm90_bwd_gpu import _space
        configs += [pa.values[1] for pa in _space() if pa.values[1].head_dim == 64]
        configs = list(dict.fromkeys(configs))
    assert all(c.problems() == [] for c in configs), [c.name for c in configs if c.problems()]
    res = precompile(configs)
    for c, secs, err in res:
        print(f"{c.name:<60} {secs:6.1f} s {err[:300] if err else 'ok'}")
    print(f"{len(configs)} kernels in {time.time() - t0:.0f} s; errors: {sum(bool(e) for _, _, e in res)}")
    sys.exit(1 if any(e for _, _, e in res) else 0)
