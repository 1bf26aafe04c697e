"""A window's tile_overlap forward and dq_first backward (session 21), without a GPU: cuflash.band's block
coverage against a brute-force mask, the configs' rules, and for_bounds / dq_first_covers with the call's
bounds (the GPU side is tests/test_window_overlap_gpu.py)."""
import itertools

import pytest

from cuflash import registry
from cuflash.band import Band, every_q_block_has_keys, every_q_block_visited
from cuflash.families import sm90_bwd, sm90_fwd
from cuflash.problem import Problem

from test_band_cpu import CASES, keep_mask  # noqa: E402

FWD = registry.get("sm90_fwd")
BWD = registry.get("sm90_bwd")
MORE = [(2049, 1500, True, (256, 0)), (1023, 113, False, (0, 0)), (1500, 2049, True, (17, 0)),
        (2049, 2049, False, (-1, 37)), (113, 1023, False, (200, -1)), (0, 5, False, (3, 3)), (5, 0, True, (3, 0))]


@pytest.mark.parametrize("sq,sk,causal,window", CASES + MORE)
def test_block_coverage_matches_the_element_rule(sq, sk, causal, window):
    keep = keep_mask(sq, sk, causal, window)
    band = Band(sq, sk, causal, window)
    for BM, BN in ((16, 16), (64, 128), (128, 128), (48, 32)):
        rows_see = [keep[m * BM:(m + 1) * BM].any() for m in range(-(-sq // BM))]
        # every Q block with a visible element is in some K/V block's range (the ranges cover the
        # visible elements); a Q block without one may still be (ranges are block-granular)
        assert every_q_block_has_keys(band, BM, BN) == (sk > 0 and all(
            len(band.kv_blocks(m * BM, BM, BN)) > 0 for m in range(len(rows_see))))
        if all(rows_see):
            assert every_q_block_visited(band, BM, BN), (BM, BN)
            assert every_q_block_has_keys(band, BM, BN) or sq == 0, (BM, BN)
        visited = set()
        for n in range(-(-sk // BN)):
            visited |= set(range(band.q_block_begin(n * BN, BM), band.q_block_end(n * BN, BM, BN, len(rows_see))))
        assert every_q_block_visited(band, BM, BN) == (visited >= set(range(len(rows_see))))


def window_problem(op, causal, sq=8192, sk=8192, window=None, dtype="bf16"):
    window = window or ((1024, 0) if causal else (1024, 1024))
    return Problem(op, dtype, 2, sq, sk, 16, 16, 128, causal, features=("window",), window=window)


def test_fwd_config_rules():
    for causal, sched in itertools.product((True, False), ((True, True), (True, False), (False, True), (False, False))):
        dyn, tmao = sched
        c = sm90_fwd.Sm90FwdConfig(128, 128, 2, 2, True, True, 128, "bf16", causal, window=True, dynamic=dyn,
                                   tma_store=tmao, tile_overlap=True)
        assert c.problems(227 * 1024) == [], c.name
        assert c.name.endswith("_win_tov"), c.name
        plain = c.replace(window=False)
        assert plain.problems(227 * 1024) != [] or (not causal and not dyn and not tmao), plain.name
    c = sm90_fwd.Sm90FwdConfig(128, 128, 2, 2, True, False, 128, "bf16", True, window=True, tile_overlap=True)
    assert c.problems(227 * 1024), "tile_overlap needs the persistent grid"
    c = sm90_fwd.Sm90FwdConfig(128, 128, 2, 2, True, True, 128, "bf16", True, window=True, softcap=True,
                               tile_overlap=True)
    assert c.problems(227 * 1024), "tile_overlap with softcap"


def test_fwd_for_problem_and_bounds():
    for causal in (True, False):
        p = window_problem("fwd", causal)
        cfg = FWD.for_problem(FWD.heuristic(p).replace(tile_overlap=True), p)
        assert cfg.tile_overlap and cfg.window, cfg.name
        assert FWD.for_bounds(cfg, p).tile_overlap
        # a Q block without keys: dropped per call
        bad = window_problem("fwd", causal, 2049, 1500, (256, 0) if causal else (0, 0))
        cfg = FWD.for_problem(FWD.heuristic(bad).replace(tile_overlap=True), bad)
        assert cfg.tile_overlap and not FWD.for_bounds(cfg, bad).tile_overlap
        # with other features: dropped by for_problem
        sp = p.replace(features=("softcap", "window"), softcap=30.0)
        assert not FWD.for_problem(FWD.heuristic(sp).replace(tile_overlap=True), sp).tile_overlap


def test_bwd_dq_first_covers_windows():
    assert sm90_bwd.dq_first_covers(window_problem("bwd", True))
    assert sm90_bwd.dq_first_covers(window_problem("bwd", False))
    assert sm90_bwd.dq_first_covers(window_problem("bwd", True, 113, 1023, (17, 0)))
    assert not sm90_bwd.dq_first_covers(window_problem("bwd", True, 1023, 113, (17, 0)))
    assert not sm90_bwd.dq_first_covers(window_problem("bwd", False, 1023, 113, (0, 0)))
    assert not sm90_bwd.dq_first_covers(window_problem("bwd", True).replace(deterministic=True))
    sp = window_problem("bwd", True).replace(features=("softcap", "window"), softcap=30.0)
    assert not sm90_bwd.dq_first_covers(sp)
    for causal in (True, False):
        p = window_problem("bwd", causal)
        cfg = BWD.for_problem(BWD.heuristic(p).replace(dq_first=True), p)
        assert cfg.dq_first and cfg.window and cfg.problems(227 * 1024) == [], cfg.name
        bad = window_problem("bwd", causal, 1023, 113, (17, 0) if causal else (0, 0))
        assert not BWD.for_bounds(cfg, bad).dq_first
        assert BWD.for_bounds(cfg, p).dq_first


def test_heuristic_switches():
    """The heuristic takes tile_overlap / dq_first for a window only where sm90_fwd.WINDOW_TILE_OVERLAP /
    sm90_bwd.WINDOW_DQ_FIRST list its class."""
    for causal in (True, False):
        fp, bp = window_problem("fwd", causal), window_problem("bwd", causal)
        f = FWD.for_problem(FWD.heuristic(fp), fp)
        b = BWD.for_problem(BWD.heuristic(bp), bp)
        assert f.tile_overlap == ((128, causal, "bf16") in sm90_fwd.WINDOW_TILE_OVERLAP), f.name
        assert b.dq_first == ((128, "bf16") in sm90_bwd.WINDOW_DQ_FIRST), b.name
        plain = FWD.for_problem(FWD.heuristic(fp.replace(features=(), window=(-1, -1))), fp.replace(features=()))
        assert not (plain.tile_overlap and plain.causal), plain.name


def test_ptxas_new_window_kernels_no_spills_not_serialized():
    """The window's new kernels (tests/test_window_overlap_gpu.py's and the timing candidates): zero spills and no
    serialized wgmma (ptxas's C7510-C7516 *info* lines, which parse_ptxas does not count), one nvcc run a family
    (nvcc 13.0, sm_90a)."""
    import re
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from cuflash.compile import kernel_param_decl, parse_ptxas, render_source

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    import features_overhead_timing as timing
    import test_window_overlap_gpu as gpu_test

    cfgs = gpu_test.all_test_configs() + [c for causal in (True, False)
                                          for _, _, c in timing.fwd_candidates("window", causal, quick=True)]
    cfgs += [c for causal in (True, False) for _, c in timing.bwd_candidates("window", causal, quick=True)]
    for fam in (FWD, BWD):
        mine = [c for c in dict.fromkeys(cfgs) if registry.family_of(c) is fam]
        assert mine
        exprs = [fam.kernel_names(c)["main"] for c in mine]
        lines = [render_source(fam.name), '#line 1 "inst"'] + [
            f"template __global__ void {e}({kernel_param_decl(fam, 'main', e)});" for e in exprs]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.cu"
            path.write_text("\n".join(lines) + "\n")
            proc = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v", "-o",
                                   str(Path(tmp) / "k.cubin"), str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        log = proc.stderr + proc.stdout
        assert not re.search(r"\(C751[0-6]\)|serialized", log), log[-2000:]
        reports = parse_ptxas(log)
        assert len(reports) == len(exprs) and all(r.spill_stores == r.spill_loads == 0 for r in reports), reports


def test_heuristic_switches_on(monkeypatch):
    """With the switches on, a window call's heuristic takes the flags (MHA: wide_epi), and for_bounds still
    drops tile_overlap / dq_first where the call's bounds leave a Q block without keys."""
    monkeypatch.setattr(sm90_fwd, "WINDOW_TILE_OVERLAP", {(128, True, "bf16"): dict(dynamic=True, tma_store=True),
                                                          (128, False, "bf16"): dict(dynamic=False, tma_store=False)})
    for name in ("WINDOW_DQ_FIRST", "WINDOW_WIDE_EPI", "WINDOW_DQ_CONVERT"):
        monkeypatch.setattr(sm90_bwd, name, frozenset({(128, "bf16")}))
    for causal in (True, False):
        fp, bp = window_problem("fwd", causal), window_problem("bwd", causal)
        f = FWD.for_problem(FWD.heuristic(fp), fp)
        assert f.tile_overlap and f.dynamic == causal and f.tma_store == causal and not f.problems(), f.name
        b = BWD.for_problem(BWD.heuristic(bp), bp)
        assert b.dq_first and b.wide_epi and b.dq_convert and b.dynamic and not b.problems(), b.name
        gqa = bp.replace(nheads_kv=4)
        assert not BWD.for_problem(BWD.heuristic(gqa), gqa).wide_epi
        bad_f = window_problem("fwd", causal, 2049, 1500, (256, 0) if causal else (0, 0))
        assert not FWD.for_bounds(f, bad_f).tile_overlap
        bad_b = window_problem("bwd", causal, 1023, 113, (17, 0) if causal else (0, 0))
        assert not BWD.for_bounds(b, bad_b).dq_first
        fp16 = bp.replace(dtype="fp16")
        assert not BWD.for_problem(BWD.heuristic(fp16), fp16).dq_first
        assert not FWD.for_problem(FWD.heuristic(fp.replace(dtype="fp16")), fp.replace(dtype="fp16")).tile_overlap
        long = window_problem("fwd", causal, 32768, 32768)
        assert not FWD.for_problem(FWD.heuristic(long), long).tma_store


def test_window_default_given_to_a_plain_call():
    """A window call whose band reaches past every key runs as the plain call (cuflash.api), with the config
    given for the window: its tile_overlap schedule (causal, static + TMA store) is not the plain kernel's, so
    for_problem drops the flag and the config stays valid (session 21's round 3 found it: ConfigError)."""
    for causal in (True, False):
        cfg = FWD.for_problem(FWD.heuristic(window_problem("fwd", causal)), window_problem("fwd", causal))
        assert cfg.tile_overlap and cfg.window
        plain = Problem("fwd", "bf16", 2, 17, 1, 4, 2, 128, causal)
        got = FWD.for_problem(cfg, plain)
        assert not got.window and got.problems() == [], got.name
        assert got.tile_overlap == (not causal and not got.dynamic and not got.tma_store and not got.q_double)
