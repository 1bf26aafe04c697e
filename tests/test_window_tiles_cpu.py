"""A window's edge halves (sm90_fwd kEdgeHalf, edge_half) without a GPU: the half rule (cuflash.band
Band.visible_half, a mirror of sm90_fwd.cu band_visible_half) against a brute-force mask, the computed share it
gives, the config's rules, name and template tail, for_problem / the heuristic's switch, and ptxas: the kernels
compile without spills and without serialized wgmmas (the body compiled once per consumer warpgroup)."""
import itertools
import shutil

import numpy as np
import pytest

from cuflash import registry
from cuflash.band import Band, block_stats, edge_half_computed
from cuflash.families import sm90_fwd
from cuflash.problem import Problem

from test_band_cpu import CASES, keep_mask  # noqa: E402

FWD = registry.get("sm90_fwd")
MORE = [(2049, 1500, True, (256, 0)), (1500, 2049, True, (17, 0)), (2049, 2049, False, (-1, 37)),
        (1023, 1023, False, (200, -1)), (1100, 1100, False, (64, 64)), (300, 300, True, (1024, 0))]


def extended_keep(sq, sk, causal, window, rows_to):
    """keep_mask with the queries past seqlen_q (the last Q block's rows the kernel computes and drops) by the
    same formula."""
    i = np.arange(rows_to)[:, None]
    j = np.arange(sk)[None, :]
    diag = i + sk - sq
    left, right = window
    right = 0 if causal else right
    keep = np.ones((rows_to, sk), bool)
    if right >= 0:
        keep &= j <= diag + right
    if left >= 0:
        keep &= j >= diag - left
    return keep


@pytest.mark.parametrize("sq,sk,causal,window", CASES + MORE)
def test_visible_half_matches_the_element_rule(sq, sk, causal, window):
    band = Band(sq, sk, causal, window)
    for BM, BN, rows in ((128, 128, 64), (64, 32, 16), (32, 16, 32)):
        m_blocks = -(-sq // BM)
        keep = extended_keep(sq, sk, causal, window, m_blocks * BM)
        for m in range(m_blocks):
            for n in band.kv_blocks(m * BM, BM, BN):
                for r0 in range(m * BM, m * BM + BM, rows):
                    sub = keep[r0:r0 + rows, n * BN:min(sk, n * BN + BN)]
                    first, second = sub[:, :BN // 2].any(), sub[:, BN // 2:].any()
                    got = band.visible_half(r0, n, BN, rows)
                    if first or second:   # (no visible key: either half, or both, is right)
                        assert got == (0 if first == second else 1 if first else 2), (BM, BN, r0, n)
                    if got:   # a hidden half means a masked block (the kernel masks the stale half)
                        assert band.needs_mask(r0, n, BN, rows)
    assert np.array_equal(keep_mask(sq, sk, causal, window), extended_keep(sq, sk, causal, window, sq))


def test_edge_half_computed_share():
    """The analysis' figures: causal window 1024 at 8k, BM 128 x BN 128, 64-row warpgroups: 1.124 -> 1.061 x the
    visible elements; (1024, 1024): 1.058 -> 1.029."""
    for window, plain, half in (((1024, 0), 1.124, 1.061), ((1024, 1024), 1.058, 1.029)):
        band = Band(8192, 8192, window[1] == 0, window)
        st = block_stats(band, 128, 128, 64)
        assert round(st.overcompute, 3) == plain
        assert round(edge_half_computed(band, 128, 128, 64) / st.visible, 3) == half


def window_config(causal, **kw):
    return sm90_fwd.Sm90FwdConfig(128, 128, 2, 2, True, True, 128, "bf16", causal, window=True, tma_store=True,
                                  tile_overlap=True).replace(**kw)


def test_config_rules_name_and_template_tail():
    for causal in (True, False):
        base = window_config(causal)
        on = base.replace(edge_half=1)
        assert on.problems(227 * 1024) == [] and on.name == base.name + "_eh"
        assert base.replace(edge_half=2).name == base.name + "_eh2" and not base.replace(edge_half=2).problems()
        assert on.kernel_name().endswith(", false, 1>") and on.template_args()[-1] == 1
        assert base.template_args()[-1] == 0 and not base.kernel_name().endswith(", 0>")
        assert on.replace(edge_half=4).problems() and not on.replace(edge_half=3).problems()
        assert FWD.decode(FWD.encode(on), "bf16", causal).edge_half and "edge_half" not in FWD.encode(base)
        assert "edge_half" not in FWD.space
        for bad in (dict(window=False, tile_overlap=False), dict(BN=144), dict(softcap=True, tile_overlap=False),
                    dict(alibi=True, tile_overlap=False), dict(dropout=True, tile_overlap=False),
                    dict(varlen=True, tile_overlap=False, tma_store=False), dict(lazy_rescale=True),
                    dict(BM=192, consumers=3, BN=64)):
            assert any("edge_half" in w for w in on.replace(**bad).problems(227 * 1024)), bad
    cl = sm90_fwd.Sm90FwdConfig(128, 176, 2, 2, True, True, 128, "bf16", False, cluster=True)
    assert len(cl.template_args()) == len(cl.replace(cluster=False).template_args())   # (2,) in, kEdgeHalf out


def test_for_problem_and_the_switch(monkeypatch):
    for causal in (True, False):
        p = Problem("fwd", "bf16", 2, 8192, 8192, 16, 16, 128, causal, features=("window",),
                    window=(1024, 0) if causal else (1024, 1024))
        heur = FWD.for_problem(FWD.heuristic(p), p)
        assert not heur.edge_half                       # (WINDOW_EDGE_HALF: where measured faster)
        on = FWD.for_problem(heur.replace(edge_half=1), p)
        assert on.edge_half and on.problems() == []
        # dropped by for_problem with another feature or varlen
        for q in (p.replace(features=("softcap", "window"), softcap=30.0),
                  p.replace(features=("varlen", "window"))):
            assert not FWD.for_problem(FWD.heuristic(q).replace(edge_half=1), q).edge_half
        monkeypatch.setattr(sm90_fwd, "WINDOW_EDGE_HALF", {(128, causal, "bf16"): 1})
        assert FWD.for_problem(FWD.heuristic(p), p) == on
        assert not FWD.heuristic(p.replace(dtype="fp16")).edge_half
        monkeypatch.undo()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_ptxas_edge_half_kernels_no_spills_no_serialized_wgmma():
    """The window heuristic's kernels with edge_half 1 and 2 (and 3), both masks, bf16 and fp16, with and without tile_overlap:
    no spill, no ptxas warning, no serialized wgmma (C7510-C7515 warnings; C7520 info, which a run-time warpgroup
    index gave, session 22)."""
    from test_features_opt_cpu import _ptxas_log

    from cuflash.compile import parse_ptxas

    cfgs = [window_config(causal, edge_half=eh, dtype=dtype, tile_overlap=tov)
            for causal, dtype, tov, eh in itertools.product((True, False), ("bf16", "fp16"), (True, False), (1, 2))]
    cfgs += [window_config(True, edge_half=3)]
    log = _ptxas_log(cfgs)
    reports = parse_ptxas(log)
    assert len(reports) == len(cfgs)
    for r in reports:
        assert (r.spill_stores, r.spill_loads, r.warnings) == (0, 0, ()), r
    assert not any(c in log for c in ("C7520", "C7511", "C7510", "C7515", "serialized")), \
        [line for line in log.splitlines() if "C75" in line and "C7519" not in line]
