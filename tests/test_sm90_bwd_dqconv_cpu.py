"""sm90_bwd's dq_convert (kDqConvert, session 17: the dQ convert inside the main kernel, Sm90BwdDqQueue in
kernels_cu/sm90_bwd.cu) and the tuning space's cleanliness, without a GPU: the config field, its name and
template argument, the rules (head dim 128 with the dynamic scheduler, 256 with roles; plain unordered
fixed-length calls), for_problem dropping it elsewhere, the plan (no convert_dq launch; the counter buffer's
size), the heuristic switch (HEURISTIC_DQ_CONVERT, off until measured); s_ahead out of the space; every
valid point of the space among the kernels recorded clean (tests/sm90_bwd_space_clean.txt: zero spills,
no serialized wgmma, nvcc 13.0; tests/sm90_bwd_space_scan.py writes it) and, with nvcc, the dq_convert
kernels compile clean (with --nvcc-all: every valid point of the space, live).
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
from cuflash.families.sm90_bwd import Sm90BwdConfig  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

from conftest import nvcc_all  # noqa: E402
from test_sm90_bwd_sched_cpu import compile_clean  # noqa: E402

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
FAM = registry.get("sm90_bwd")
RECORD = os.path.join(_here, "sm90_bwd_space_clean.txt")


def problem(head_dim=128, causal=False, dtype="bf16", deterministic=False, features=(), seqlen=2048, **kw):
    return Problem("bwd", dtype, 8, seqlen, seqlen, 2048 // head_dim if head_dim != 192 else 8,
                   2048 // head_dim if head_dim != 192 else 8, head_dim, causal, deterministic,
                   features=features, **kw)


def heur(p):
    """The heuristic's config without dq_first (session 18, on at some 2k classes: it is appended after
    dq_convert in names and template arguments; tests/test_sm90_bwd_dqfirst_cpu.py holds it) and wide_epi
    (session 20, appended after dq_first; tests/test_sm90_bwd_wide_dyn_cpu.py)."""
    return FAM.for_problem(FAM.heuristic(p).replace(dq_first=False, wide_epi=False), p)


def dqc(p):
    return FAM.for_problem(heur(p).replace(dq_convert=True), p)


def test_field_name_template():
    p = problem()
    cfg = dqc(p)
    base = heur(p)
    assert cfg.dq_convert and cfg.problems() == [] and cfg.name == base.name + "_dqc"
    # kDqConvert last: kRoles written out before it; the other kernels keep their name expressions
    assert cfg.kernel_name() == base.kernel_name()[:-1] + ", false, true>"
    assert len(cfg.template_args()) == 31 and cfg.template_args()[-6] is True   # (kDqFirst, kWideEpi, kDropPacked, kCapFold, kDqTail last)
    d256 = dqc(problem(256, True))
    assert d256.roles and d256.kernel_name() == heur(problem(256, True)).kernel_name()[:-1] + ", true>"
    assert FAM.decode(FAM.encode(cfg), "bf16", False) == cfg and "dq_convert" not in FAM.encode(base)
    # outside the tuning space until measured; a point without it gets it off
    assert "dq_convert" not in FAM.space
    assert FAM.make(FAM.point(cfg), p) == FAM.make(FAM.point(base), p)
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    assert "bool kFragPin = false, bool kRoles = false, bool kDqConvert = false, bool kDqFirst = false," in src
    assert f"static constexpr int kRows = {sm90_bwd.DQ_CONVERT_ROWS};" in src
    assert f"static constexpr int kQueues = {sm90_bwd.DQ_CONVERT_QUEUES};" in src


def test_rules_and_for_problem():
    p = problem()
    cfg = dqc(p)
    why = lambda c: " ".join(c.problems())   # noqa: E731
    for change in (dict(dynamic=False, frag_pin=False), dict(dq_writer=False),
                   dict(softcap=True), dict(varlen=True, dynamic=False), dict(dropout=True)):
        assert "dq_convert" in why(cfg.replace(**change)), change
    assert "dq_convert" not in why(cfg.replace(window=True))   # (a window's: session 21)
    assert "dq_convert" in why(Sm90BwdConfig(128, 128, 2, 2, 64, "bf16", False, dq_writer=True, dynamic=True,
                                             dq_convert=True))                  # head dim 64: spills
    assert "dq_convert" in why(Sm90BwdConfig(64, 64, 2, 2, 256, "bf16", False, dq_writer=True,
                                             dq_convert=True))                  # d256 without roles
    assert "dq_convert" in why(Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False, True, dq_convert=True))
    # for_problem drops it where it is not built
    for q in (problem(deterministic=True), problem(features=("softcap",), softcap=5.0), problem(64)):
        got = FAM.for_problem(FAM.heuristic(q).replace(dq_convert=True), q)
        assert not got.dq_convert and got.problems() == [], got.name
    q = problem(features=("window",), window=(128, 0))   # kept with a window (session 21)
    assert FAM.for_problem(FAM.heuristic(q).replace(dq_convert=True), q).dq_convert
    for d, causal, dtype in itertools.product((128, 192, 256), (False, True), ("bf16", "fp16")):
        got = dqc(problem(d, causal, dtype))
        assert got.dq_convert and got.problems() == [], got.name


def test_plan_launches_and_counters():
    p = problem()
    cfg, base = dqc(p), heur(p)
    roles = [s.role for s in FAM.launches(cfg, p, 132)]
    assert roles == ["preprocess", "main"] and [s.role for s in FAM.launches(base, p, 132)][-1] == "convert_dq"
    pairs, chunks = p.batch * p.nheads, -(-p.seqlen_q // sm90_bwd.DQ_CONVERT_ROWS)
    q = sm90_bwd.DQ_CONVERT_QUEUES
    assert FAM.zeroed_counters(cfg, p) == {"tile_counter": 2 + 2 * q + pairs + q * (-(-pairs // q) * chunks)}
    assert FAM.zeroed_counters(base, p) == {"tile_counter": 1}
    d256 = dqc(problem(256, True))
    assert FAM.zeroed_counters(d256, problem(256, True))["tile_counter"] == 2 + 32 + 64 + 16 * 4 * 8
    gqa = Problem("bwd", "bf16", 2, 1023, 1100, 4, 2, 128, True)
    assert [s.role for s in FAM.launches(dqc(gqa), gqa, 132)] == ["preprocess", "main", "reduce_dkv"]


def test_heuristic_switch(monkeypatch):
    # as shipped (session 17 round 2; fp16 non-causal left in session 19, its kernel spills): d128 causal,
    # seqlen <= 4k
    assert sm90_bwd.HEURISTIC_DQ_CONVERT == {(128, True, "bf16"), (128, True, "fp16")}
    assert sm90_bwd.DQ_CONVERT_MAX_SEQLEN == 4096
    for d, causal, dtype in itertools.product((64, 96, 128, 256), (False, True), ("bf16", "fp16")):
        on = d in (96, 128) and causal
        for s in (2048, 4096, 8192):
            cfg = heur(problem(d, causal, dtype, seqlen=s))
            assert cfg.dq_convert == (on and s <= 4096) and cfg.problems() == [], (s, cfg.name)
        assert not heur(problem(d, causal, dtype, deterministic=True)).dq_convert
        assert not heur(problem(d, causal, dtype, features=("window",), window=(128, 0))).dq_convert
    assert [s.role for s in FAM.launches(heur(problem(128, True)), problem(128, True), 132)] == ["preprocess", "main"]
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_DQ_CONVERT",
                        frozenset(itertools.product((64, 128, 256), (False, True), ("bf16", "fp16"))))
    for d, causal, dtype in itertools.product((64, 128, 192, 256), (False, True), ("bf16", "fp16")):
        cfg = heur(problem(d, causal, dtype))
        assert cfg.dq_convert == (d != 64) and cfg.problems() == [], cfg.name
        assert not heur(problem(d, causal, dtype, deterministic=True)).dq_convert
        assert not heur(problem(d, causal, dtype, features=("softcap",), softcap=5.0)).dq_convert


# ---------------------------------------------------------------------------------------
# the tuning space: no s_ahead; every valid point compiled clean (recorded, or live with --nvcc-all)

def space_problems():
    return [problem(d, causal, dtype) for d in (64, 128, 256) for dtype in ("bf16", "fp16")
            for causal in (False, True)]


def space_kernels():
    out = {}
    for p in space_problems():
        for cfg in FAM.valid(p):
            out.setdefault(cfg.name, cfg)
    return out


def test_space_has_no_s_ahead():
    assert "s_ahead" not in FAM.space
    refused = Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False, dq_writer=True, s_ahead=True)
    assert "s_ahead: ptxas serializes" in " ".join(refused.problems())
    assert not any(c.s_ahead for c in space_kernels().values())


def recorded_clean():
    with open(RECORD) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def test_space_points_recorded_clean():
    """Every valid point of the space (head dims 64 / 128 / 256, both dtypes and masks) is among the kernels
    recorded clean (no spills, no serialized wgmma). A new point (a new flag or rule) fails here until
    tests/sm90_bwd_space_scan.py has compiled it (and it is clean, or a rule refuses it)."""
    missing = sorted(set(space_kernels()) - recorded_clean())
    assert not missing, ("valid points not recorded clean (run tests/sm90_bwd_space_scan.py):\n"
                         + "\n".join(missing[:40]))


@needs_nvcc
def test_dq_convert_kernels_compile_clean(request):
    """Two dq_convert kernels (bf16 head dim 128 non-causal, 256 causal); with --nvcc-all all eight (bf16 /
    fp16, both masks) and every valid point of the space too (about 700 kernels: an hour on 2 cores)."""
    cfgs = [dqc(problem(128)), dqc(problem(256, True))]
    if nvcc_all(request.config):
        cfgs = [dqc(problem(d, causal, dtype)) for d in (128, 256) for dtype in ("bf16", "fp16")
                for causal in (False, True)] + list(space_kernels().values())
    assert compile_clean(cfgs) == []
