"""cuflash.band (the host mirror of mask.cuh BandMask) against a brute-force mask, and the
sliding-window tile choice of sm90_fwd's heuristic. No GPU, no compiler."""
import numpy as np
import pytest

from cuflash import registry
from cuflash.band import Band, aligned_bn, block_stats, visible_fraction
from cuflash.problem import Problem

CASES = [  # seqlen_q, seqlen_k, causal, window
    (8, 8, False, (-1, -1)), (8, 8, True, (-1, -1)), (37, 37, True, (5, 0)), (37, 50, False, (6, 3)),
    (50, 37, True, (4, -1)), (50, 37, False, (-1, 2)), (17, 113, False, (0, 0)), (113, 17, True, (20, 0)),
    (64, 64, False, (3, 200)), (1, 33, True, (7, 0)),
]
TILES = [(16, 16), (16, 48), (32, 16), (64, 176), (48, 32)]


def keep_mask(sq, sk, causal, window):
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    diag = i + sk - sq
    left, right = window
    if causal:
        right = 0
    keep = np.ones((sq, sk), bool)
    if right >= 0:
        keep &= j <= diag + right
    if left >= 0:
        keep &= j >= diag - left
    return keep


@pytest.mark.parametrize("sq,sk,causal,window", CASES)
def test_band_matches_the_element_rule(sq, sk, causal, window):
    band = Band(sq, sk, causal, window)
    keep = keep_mask(sq, sk, causal, window)
    assert band.visible() == keep.sum()
    assert [band.visible_keys(i) for i in range(sq)] == list(keep.sum(1))
    for BM, BN in TILES:
        m_blocks, n_blocks = -(-sq // BM), -(-sk // BN)
        pad = np.zeros((m_blocks * BM, n_blocks * BN), bool)
        pad[:sq, :sk] = keep
        real = np.zeros_like(pad)
        real[:sq, :] = True
        for m in range(m_blocks):
            r0 = m * BM
            blocks = band.kv_blocks(r0, BM, BN)
            for n in range(n_blocks):
                tile = pad[r0:r0 + BM, n * BN:(n + 1) * BN]
                rows_real = real[r0:r0 + BM, n * BN:(n + 1) * BN]
                if tile.any():
                    assert n in blocks, (BM, BN, m, n)
                if n in blocks and (rows_real & ~tile).any():
                    assert band.needs_mask(r0, n, BN, BM), (BM, BN, m, n)
            # exact: the first and the last visited block hold a visible element
            if len(blocks):
                for n in (blocks[0], blocks[-1]):
                    assert pad[r0:r0 + BM, n * BN:(n + 1) * BN].any(), (BM, BN, m, n)
        for n in range(n_blocks):
            lo, hi = band.q_block_begin(n * BN, BM), band.q_block_end(n * BN, BM, BN, m_blocks)
            for m in range(m_blocks):
                if pad[m * BM:(m + 1) * BM, n * BN:(n + 1) * BN].any():
                    assert lo <= m < hi, (BM, BN, n, m)


def test_block_stats_of_the_issue_case():
    """Window 1024 causal at 8k (the features benchmark's case): BN 128 visits 9 blocks per Q
    block once the band is full; BN 176 misaligns and computes more."""
    band = Band(8192, 8192, True, (1024, 0))
    aligned, plain = block_stats(band, 128, 128, 64), block_stats(band, 128, 176, 64)
    assert aligned.max_visits == 9 and aligned.q_blocks == 64
    assert aligned.overcompute == pytest.approx(1.124, abs=2e-3)
    assert plain.overcompute == pytest.approx(1.279, abs=2e-3)
    assert aligned.masked_share < plain.masked_share
    causal = block_stats(Band(8192, 8192, True), 128, 160, 64)
    assert causal.overcompute == pytest.approx(1.031, abs=2e-3)
    assert visible_fraction(8192, 8192, True, (1024, 0)) == pytest.approx(0.2346, abs=1e-4)
    assert visible_fraction(8192, 8192, False, (1024, 1024)) == pytest.approx(0.2345, abs=1e-4)
    assert visible_fraction(64, 64, False) == 1.0
    assert aligned_bn(128, (64, 80, 128, 176)) == [128, 64]


def test_block_stats_count_masked_groups():
    # 2 Q blocks of 4 rows, 1 key block of 8: causal diagonal, masked per group of 2 rows
    band = Band(8, 8, True)
    st = block_stats(band, 4, 8, 2)
    assert st.kv_visits == 2 and st.computed == 64 and st.visible == 36
    # every (Q block, group of 2 rows) hides keys past its diagonal: 4 groups of half a block
    assert st.masked == 2.0


def window_problem(d, features=("window",), causal=True):
    return Problem("fwd", "bf16", 2, 8192, 8192, 2048 // d, 2048 // d, d, causal,
                   features=tuple(sorted(features)), window=(1024, 0))


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_sm90_window_heuristic_aligns_bn(d):
    fam = registry.get("sm90_fwd")
    for feats in (("window",), ("alibi", "window"), ("alibi", "softcap", "window")):
        for causal in (False, True):
            p = window_problem(d, feats, causal)
            cfg = fam.for_problem(fam.heuristic(p), p)
            assert cfg.BM % cfg.BN == 0 and cfg.persistent and cfg.window, cfg.name
            assert not cfg.problems(), cfg.problems()
    plain = fam.heuristic(window_problem(128, ()))
    # the plain heuristic: the dynamic persistent schedule, BN 160 (with the TMA store) below 16k keys
    assert (plain.BN, plain.persistent, plain.dynamic) == (160, True, True)
