"""Session 23's window levers without a GPU: sm90_fwd unmasked_first (kUnmaskedFirst, a band's masked last K/V
block visited second or last) and sm90_bwd convert_early (kConvertEarly, the in-kernel dQ convert's jobs by
ticket at the dynamic loop's tile boundaries): fields, names, template tails, rules, the ticket buffer's size,
the host mirror of the block order, and (with nvcc) the kernels' ptxas reports (no serialized wgmma; spills as
recorded). The GPU side is tests/test_window_order_gpu.py."""
import os
import shutil
import sys

import pytest

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

from cuflash import registry  # noqa: E402
from cuflash.compile import kernel_dir  # noqa: E402
from cuflash.families import sm90_bwd  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
FWD = registry.get("sm90_fwd")
BWD = registry.get("sm90_bwd")
WINDOWS = {True: (1024, 0), False: (1024, 1024)}


def window_problem(op, causal, sq=8192):
    return Problem(op, "bf16", 2, sq, sq, 16, 16, 128, causal, features=("window",), window=WINDOWS[causal])


def heur(fam, p):
    return fam.for_problem(fam.heuristic(p), p)


def band_block(j, n_end, n_blocks, form):
    """sm90_fwd.cu's band_block: the loop's block j."""
    if form == 1 and n_blocks >= 3 and j < 2:
        return n_end - 2 + j
    if form == 2 and n_blocks >= 3:
        return n_end - 1 if j == n_blocks - 1 else n_end - 2 - j
    return n_end - 1 - j


@pytest.mark.parametrize("causal", [True, False])
def test_unmasked_first_config(causal):
    p = window_problem("fwd", causal)
    base = heur(FWD, p)
    assert base.unmasked_first == 0 and "_uf" not in base.name
    for form in (1, 2):
        cfg = FWD.for_problem(base.replace(unmasked_first=form), p)
        assert cfg.unmasked_first == form and cfg.problems() == [] and cfg.name == base.name + f"_uf{form}"
        assert cfg.kernel_name().endswith(f", {form}>") and cfg.template_args()[-1] == form
        assert FWD.decode(FWD.encode(cfg), "bf16", causal).replace(window=True) == cfg
    assert "unmasked_first" not in FWD.encode(base)          # the shipped configs' encoded form unchanged
    assert base.kernel_name() == base.replace(unmasked_first=0).kernel_name() and not base.kernel_name().endswith(", 0>")
    plain = heur(FWD, Problem("fwd", "bf16", 2, 8192, 8192, 16, 16, 128, causal))
    # window or causal calls (a plain causal tile's last block is the masked diagonal too)
    assert any("unmasked_first" in w for w in plain.replace(unmasked_first=1).problems()) != causal
    assert any("unmasked_first" in w for w in base.replace(unmasked_first=3).problems())
    src = (kernel_dir() / "sm90_fwd.cu").read_text()
    assert "bool kDeferMax = false, int kUnmaskedFirst = 0>" in src


def test_band_block_is_a_permutation():
    for n_blocks in range(0, 12):
        for form in (0, 1, 2):
            order = [band_block(j, 20, n_blocks, form) for j in range(n_blocks)]
            assert sorted(order) == list(range(20 - n_blocks, 20)), (n_blocks, form, order)
            if form and n_blocks >= 3:
                assert order[0] == 18 and order[1 if form == 1 else -1] == 19


@pytest.mark.parametrize("causal", [True, False])
def test_convert_early_config(causal):
    p = window_problem("bwd", causal)
    base = heur(BWD, p)
    assert base.dynamic and not base.convert_early
    cfg = BWD.for_problem(base.replace(dq_convert=True, convert_early=True), p)
    assert cfg.convert_early and cfg.problems() == [] and cfg.name == base.name.replace("_dqf", "_dqc_dqf") + "_cve"
    assert cfg.kernel_name().endswith(", 0, true>") and cfg.template_args()[-1] is True
    assert base.template_args()[-1] is False and not base.kernel_name().endswith(", false>")
    # the rules: with dq_convert and the dynamic scheduler, not roles
    assert any("convert_early" in w for w in base.replace(convert_early=True).problems())
    assert any("convert_early" in w for w in cfg.replace(dynamic=False).problems())
    # for_problem keeps dq_convert (the rule's text does not name it) and drops both with other features
    sp = Problem("bwd", "bf16", 2, 8192, 8192, 16, 16, 128, causal, features=("softcap",), softcap=30.0)
    dropped = BWD.for_problem(cfg.replace(window=False, softcap=True), sp)
    assert not dropped.dq_convert and not dropped.convert_early
    # the tickets' counter buffer: claim, next ticket, tail, warps done, per-pair counts, a slot per 64-row job
    pairs = 2 * 16
    assert BWD.zeroed_counters(cfg, p) == {"tile_counter": 4 + pairs + pairs * 8192 // sm90_bwd.CONVERT_EARLY_ROWS}
    assert [sp.role for sp in BWD.launches(cfg, p, 132)] == ["preprocess", "main"]   # (no convert_dq launch)
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    assert "static constexpr int kRows = 64;                 // dQ rows a job (one warp's)" in src


@needs_nvcc
def test_ptxas_reports():
    """No serialized wgmma in any of them; unmasked_first adds no spill; convert_early's convert at the tile
    boundary (one item in flight a lane) spills 0 bytes causal, 4 full (nvcc 13.0; it is timed, not shipped)."""
    from test_sm90_bwd_sched_cpu import nvcc_compile, serialized

    cfgs, want = [], []
    for causal in (True, False):
        fp = window_problem("fwd", causal)
        base = heur(FWD, fp)
        cfgs += [FWD.for_problem(base.replace(unmasked_first=f), fp) for f in (1, 2)]
        want += [0, 0]
        bp = window_problem("bwd", causal)
        cfgs.append(BWD.for_problem(heur(BWD, bp).replace(dq_convert=True, convert_early=True), bp))
        want.append(0 if causal else 4)
    fwd, bwd = [c for c in cfgs if c.family == "sm90_fwd"], [c for c in cfgs if c.family == "sm90_bwd"]
    reports = dict(zip(fwd, nvcc_compile(fwd, "sm_90a", NVCC))) | dict(zip(bwd, nvcc_compile(bwd, "sm_90a", NVCC)))
    for c, w in zip(cfgs, want):
        r = reports[c]
        assert not serialized(r), (c.name, r)
        assert r.spill_stores <= w, (c.name, r)
