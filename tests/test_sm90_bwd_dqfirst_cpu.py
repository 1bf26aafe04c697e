"""sm90_bwd's dq_first (kDqFirst, session 18: no zeroing preprocess, the first CTA to reach a Q block zeroes
its dQ accumulator rows in the main kernel) without a GPU: the config field, its name and template argument (appended last), the
rules (dq_writer, fixed lengths, unordered, no cluster), for_problem dropping it where a query row gets no
dQ part (causal with seqlen_q > seqlen_k, features, varlen, deterministic), the plan (the preprocess without
the zeroing, the tickets in dq_semaphore's place), the heuristic switch (HEURISTIC_DQ_FIRST) and, with nvcc,
its kernels compile clean (zero spills) while the existing kernels' instantiations keep their names.
"""
import itertools
import os
import shutil
import sys

import pytest

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

from cuflash import registry  # noqa: E402
from cuflash.compile import kernel_dir  # noqa: E402
from cuflash.families import sm90_bwd  # noqa: E402
from cuflash.families.sm90_bwd import Sm90BwdConfig, dq_first_covers  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

from test_sm90_bwd_sched_cpu import compile_clean  # noqa: E402

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
FAM = registry.get("sm90_bwd")


def problem(head_dim=128, causal=False, dtype="bf16", deterministic=False, features=(), seqlens=(2048, 2048), **kw):
    h = 2048 // head_dim if head_dim != 192 else 8
    return Problem("bwd", dtype, 8, seqlens[0], seqlens[1], h, h, head_dim, causal, deterministic,
                   features=features, **kw)


def heur(p):
    return FAM.for_problem(FAM.heuristic(p), p)


# (plain, dqf: without wide_epi, appended after dq_first; tests/test_sm90_bwd_wide_dyn_cpu.py holds it)
def plain(p):
    return heur(p).replace(dq_first=False, wide_epi=False)


def dqf(p):
    return FAM.for_problem(FAM.heuristic(p).replace(dq_first=True, wide_epi=False), p)


def test_field_name_template():
    p = problem()
    cfg, base = dqf(p), plain(p)
    assert cfg.dq_first and cfg.problems() == [] and cfg.name == base.name + "_dqf"
    # kDqFirst last: kRoles, kDqConvert written out before it; the other kernels keep their name expressions
    assert cfg.kernel_name() == base.kernel_name()[:-1] + ", false, false, true>"
    assert len(cfg.template_args()) == 31 and cfg.template_args()[-5] is True   # (kWideEpi, kDropPacked, kCapFold, kDqTail last)
    assert FAM.decode(FAM.encode(cfg), "bf16", False) == cfg and "dq_first" not in FAM.encode(base)
    assert "dq_first" not in FAM.space                  # outside the tuning space
    assert FAM.make(FAM.point(cfg), p) == FAM.make(FAM.point(base), p)
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    assert "bool kRoles = false, bool kDqConvert = false, bool kDqFirst = false,\n          bool kWideEpi = false, int kDropPacked = 0, int kCapFold = 0, int kDqTail = 0>" in src
    pre = (kernel_dir() / "fa2_bwd.cu").read_text()
    assert "template <class Elem, bool kVarlen = false, bool kZeroDq = true>" in pre
    # the preprocess without the zeroing; the other kernels' names unchanged
    names, plain_names = FAM.kernel_names(cfg), FAM.kernel_names(base)
    assert names["preprocess"] == "cuflash::fa2_bwd_preprocess<cuflash::bf16, false, false>"
    assert plain_names["preprocess"] == "cuflash::fa2_bwd_preprocess<cuflash::bf16>"
    assert {k: v for k, v in names.items() if k not in ("main", "preprocess")} == \
        {k: v for k, v in plain_names.items() if k not in ("main", "preprocess")}
    d256 = dqf(problem(256, True))
    assert d256.roles and d256.kernel_name() == plain(problem(256, True)).kernel_name()[:-1] + ", false, true>"


def test_rules_and_for_problem():
    why = lambda c: " ".join(c.problems())   # noqa: E731
    cfg = dqf(problem())
    for change in (dict(dq_writer=False), dict(varlen=True, dynamic=False), dict(deterministic=True, dq_writer=False),
                   dict(BM=80, dynamic=False, frag_pin=False)):
        assert "dq_first" in why(cfg.replace(**change)), change
    assert "dq_first" in why(Sm90BwdConfig(64, 64, 2, 2, 256, "bf16", False, dq_writer=True, cluster=True,
                                           dq_first=True))
    # every query row gets a part: not causal, or causal with seqlen_q <= seqlen_k
    assert dq_first_covers(problem()) and dq_first_covers(problem(causal=True, seqlens=(113, 301)))
    assert not dq_first_covers(problem(causal=True, seqlens=(301, 113)))
    assert dq_first_covers(problem(seqlens=(301, 113)))
    # a window: where every Q block is in some K/V block's band (session 21: the call's bounds decide)
    assert dqf(problem(features=("window",), window=(128, 0))).dq_first
    for q in (problem(deterministic=True), problem(features=("softcap",), softcap=5.0),
              problem(features=("window",), window=(128, 0), seqlens=(301, 113)),
              problem(causal=True, seqlens=(301, 113)),
              problem(64, True, seqlens=(2049, 17))):
        got = dqf(q)
        assert not got.dq_first and got.problems() == [], got.name
    for d, causal, dtype in itertools.product((64, 96, 128, 192, 256), (False, True), ("bf16", "fp16")):
        got = dqf(problem(d, causal, dtype))
        assert got.dq_first and got.problems() == [], got.name


def test_plan_workspace():
    p = problem()
    cfg, base = dqf(p), plain(p)
    ws, plain_ws = FAM.workspace(cfg, p), FAM.workspace(base, p)
    assert "dq_semaphore" not in plain_ws
    rows = -(-p.seqlen_q // 128) * 128
    assert ws["dq_semaphore"] == plain_ws["total"] and \
        ws["total"] >= plain_ws["total"] + p.batch * p.nheads * rows // 16 * 4
    assert {k: v for k, v in ws.items() if k not in ("dq_semaphore", "total")} == \
        {k: v for k, v in plain_ws.items() if k != "total"}
    assert [s.role for s in FAM.launches(cfg, p, 132)] == [s.role for s in FAM.launches(base, p, 132)]


def test_heuristic_switch(monkeypatch):
    # as shipped (session 18 round 3, session 19 rounds 1-3): up to 2k d64, d128, d256 causal; fp16 d128
    # non-causal up to 4k
    assert sm90_bwd.HEURISTIC_DQ_FIRST == {(128, False, "bf16"), (128, True, "bf16"), (128, True, "fp16"),
                                           (128, False, "fp16"), (256, True, "bf16"), (256, True, "fp16"),
                                           (64, False, "bf16"), (64, False, "fp16"), (64, True, "bf16"),
                                           (64, True, "fp16")}
    assert sm90_bwd.DQ_FIRST_MAX_SEQLEN == 2048
    for d, causal, dtype in itertools.product((64, 96, 128, 192, 256), (False, True), ("bf16", "fp16")):
        on = d in (64, 96, 128) or (d in (192, 256) and causal)
        cap = 4096 if d in (96, 128) and (causal, dtype) == (False, "fp16") else 2048
        for s in (1024, 2048, 4096, 16384):
            cfg = heur(problem(d, causal, dtype, seqlens=(s, s)))
            assert cfg.dq_first == (on and (cap is None or s <= cap)) and cfg.problems() == [], (s, cfg.name)
            assert not (cfg.dq_first and cfg.dq_convert and (causal, dtype) == (False, "fp16")), cfg.name
        assert not heur(problem(d, causal, dtype, deterministic=True)).dq_first
        # (a window alone: sm90_bwd.WINDOW_DQ_FIRST's classes, session 21)
        assert heur(problem(d, causal, dtype, features=("window",), window=(128, 0))).dq_first == (
            (FAM.head_dim_of(d), dtype) in sm90_bwd.WINDOW_DQ_FIRST)
        assert heur(problem(d, causal, dtype, seqlens=(1100, 1023))).dq_first == (on and not causal)
    every = frozenset(itertools.product((64, 128, 256), (False, True), ("bf16", "fp16")))
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_DQ_FIRST", every)
    for d, causal, dtype in itertools.product((64, 128, 192, 256), (False, True), ("bf16", "fp16")):
        assert heur(problem(d, causal, dtype)).dq_first
        assert not heur(problem(d, causal, dtype, deterministic=True)).dq_first
        assert not heur(problem(d, causal, dtype, features=("softcap",), softcap=5.0)).dq_first
        assert heur(problem(d, causal, dtype, seqlens=(1023, 1100))).dq_first
        assert heur(problem(d, causal, dtype, seqlens=(1100, 1023))).dq_first == (not causal)
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_DQ_FIRST", frozenset())
    assert not any(heur(problem(d, c)).dq_first for d in (64, 128, 256) for c in (False, True))


@needs_nvcc
def test_dq_first_kernels_compile_clean():
    """The heuristic's kernels with dq_first, bf16, both masks, head dims 64 / 128 / 256: zero spills, no
    serialized wgmma (nvcc 13.0)."""
    cfgs = [dqf(problem(d, causal)) for d in (64, 128, 256) for causal in (False, True)]
    assert compile_clean(cfgs) == []
