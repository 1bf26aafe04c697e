"""sm90_bwd's session-20 flags, on the CPU: wide_epi (kWideEpi, name _w16: the epilogue's 16-byte dK / dV
stores, plain fixed-length unordered calls) and the dynamic scheduler on head dim 256's roles tile
(kDynamic with kRoles). Names, template arguments, the rules, for_problem dropping them where they do
not run, both outside the tuning space, the heuristic's switches; with nvcc, their kernels
compile clean (zero spills, no serialized wgmma; nvcc 13.0, sm_90a)."""
import os
import shutil
import sys

import pytest

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

from cuflash import registry  # noqa: E402
from cuflash.families import sm90_bwd  # noqa: E402
from cuflash.families.sm90_bwd import Sm90BwdConfig  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

from test_sm90_bwd_sched_cpu import compile_clean  # noqa: E402

needs_nvcc = pytest.mark.skipif(shutil.which(os.environ.get("NVCC", "nvcc")) is None, reason="nvcc is not on PATH")
FAM = registry.get("sm90_bwd")
ROLES = Sm90BwdConfig(64, 64, 2, 2, 256, "bf16", True, dq_writer=True, roles=True)


def problem(head_dim=256, causal=True, dtype="bf16", seqlen=8192, **kw):
    return Problem("bwd", dtype, 16384 // seqlen, seqlen, seqlen, 2048 // head_dim, 2048 // head_dim, head_dim,
                   causal, **kw)


def heur(p):
    return FAM.for_problem(FAM.heuristic(p), p)


def test_names_and_template_args():
    w16 = ROLES.replace(wide_epi=True)
    assert w16.name == ROLES.name + "_w16" and w16.problems() == []
    assert w16.template_args()[-4] is True and ROLES.template_args()[-4] is False   # (kDropPacked, kCapFold, kDqTail last)
    assert w16.kernel_name().endswith(", true, false, false, true>")      # kRoles, kDqConvert, kDqFirst, kWideEpi
    dyn = ROLES.replace(dynamic=True)
    assert dyn.problems() == [] and dyn.name == "sm90bwd_bf16_d256_causal_BM64_BN64_s2_c2_dqw_dyn_rol"
    assert FAM.decode(FAM.encode(w16), "bf16", True) == w16 and "wide_epi" not in FAM.encode(ROLES)


def test_rules():
    assert any("without roles" in w for w in ROLES.replace(roles=False, dynamic=True).problems())
    for flags in (dict(alibi=True), dict(dropout=True), dict(varlen=True)):
        cfg = Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False, dq_writer=True, wide_epi=True, **flags)
        assert any("wide_epi" in w for w in cfg.problems()), flags
    # a window's backward takes it (session 21: its kernels compile clean, tests/test_window_overlap_cpu.py),
    # and softcap's (session 22: zero spills, tests/test_sm90_s_ahead_cpu.py's neighbour test below)
    for flags in (dict(window=True), dict(softcap=True)):
        cfg = Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False, dq_writer=True, wide_epi=True, **flags)
        assert not any("wide_epi" in w for w in cfg.problems()), flags


def test_for_problem_and_space():
    p = problem()
    assert FAM.for_problem(ROLES.replace(dynamic=True, wide_epi=True), p) == ROLES.replace(dynamic=True, wide_epi=True)
    feat = problem(features=("alibi",))
    run = FAM.for_problem(ROLES.replace(dynamic=True, wide_epi=True), feat)
    assert not (run.dynamic or run.wide_epi or run.roles)
    det = FAM.for_problem(ROLES.replace(dynamic=True), problem(deterministic=True))
    assert not (det.dynamic or det.roles)
    assert "wide_epi" not in FAM.space
    for cfg, why in FAM.enumerate(problem(), None):
        assert not (cfg.dynamic and cfg.shared_keys) or why, cfg.name


def test_heuristic_switches(monkeypatch):
    """wide_epi for plain MHA calls of HEURISTIC_WIDE_EPI's classes (measured, session 20), not with GQA, features,
    deterministic; the d256 dynamic scheduler per HEURISTIC_D256_DYNAMIC (measured slower: empty)."""
    on = sm90_bwd.HEURISTIC_WIDE_EPI
    for d in (64, 128, 256):
        for c in (False, True):
            for dt in ("bf16", "fp16"):
                for s in (2048, 8192):
                    cfg = heur(problem(d, c, dt, s))
                    cap = sm90_bwd.WIDE_EPI_MAX_SEQLEN_BY.get((d, c, dt))   # (d64: up to 2048, session 30)
                    assert cfg.wide_epi == ((d, c, dt) in on and (cap is None or s <= cap)), cfg.name
                    assert not (d == 256 and cfg.dynamic), cfg.name
    assert (128, False, "bf16") in on and (256, True, "bf16") in on and not sm90_bwd.HEURISTIC_D256_DYNAMIC
    gqa = Problem("bwd", "bf16", 2, 2048, 2048, 16, 4, 128, False)
    assert not heur(gqa).wide_epi
    # (softcap: with the folded step, SOFTCAP_CAP_FOLD, whose d128 dynamic kernel needs it)
    cap = heur(problem(128, False, features=("softcap",), softcap=30.0))
    assert cap.wide_epi == bool(cap.cap_fold) and cap.cap_fold == sm90_bwd.SOFTCAP_CAP_FOLD.get((128, False, "bf16"), 0)
    assert not heur(problem(128, False, deterministic=True)).wide_epi
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_D256_DYNAMIC", {(True, "bf16"): 4096})
    monkeypatch.setattr(sm90_bwd, "WIDE_EPI_MAX_SEQLEN_BY", {(256, True, "bf16"): 4096})
    assert heur(problem()).dynamic and not heur(problem()).wide_epi
    assert not heur(problem(seqlen=2048)).dynamic and heur(problem(seqlen=2048)).wide_epi


@needs_nvcc
def test_kernels_compile_clean():
    """The roles tile on the dynamic scheduler (bf16 / fp16, causal or not, with dq_first) and wide_epi on the
    heuristic's d128 / d256 kernels."""
    cfgs = [ROLES.replace(dtype=dt, causal=c, dynamic=True, dq_first=f)
            for dt in ("bf16", "fp16") for c in (False, True) for f in (False, True)]
    cfgs += [heur(problem(d, c, dt, s)).replace(wide_epi=True)
             for d, c, dt, s in ((128, False, "bf16", 2048), (128, False, "bf16", 8192), (256, True, "bf16", 8192),
                                 (128, False, "fp16", 2048), (128, True, "fp16", 8192), (64, False, "bf16", 2048))]
    assert compile_clean(cfgs) == []
