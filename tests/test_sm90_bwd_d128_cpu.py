"""CPU checks of sm90_bwd's main-loop flags (issue 14, the d128 backward at cuDNN's speed):
dq_early (kDqEarly: the dQ GEMM issued behind dV, dK, one wait for the three), s_ahead (kSAhead:
the next Q block's Sᵀ issued behind the dQ GEMM) and q_rotate (kQRotate: non-causal K/V block n
visits the Q blocks from n % n_iters on).

The config fields, names, template arguments (appended after kDsDouble: every existing config
keeps its name expression and code), the space and the encoded form, the rules (where they are
built; for_problem drops them elsewhere), the heuristic's switches (off as shipped), the host
mirror of the rotated order (a permutation of the Q blocks), and the nvcc/ptxas build of the
allowed instantiations (zero spills, no "wgmma serialized"), and that the refused s_ahead ones do
spill. No GPU needed.
"""
import itertools
import os
import shutil

import pytest

from cuflash import registry
from cuflash.compile import kernel_dir
from cuflash.families import sm90_bwd
from cuflash.families.sm90_bwd import Sm90BwdConfig
from cuflash.problem import Problem

from test_sm90_bwd_sched_cpu import compile_clean, nvcc_compile  # noqa: E402

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
FAM = registry.get("sm90_bwd")
FLAGS = ("dq_early", "s_ahead", "q_rotate", "dk_late")


def problem(head_dim=128, causal=False, deterministic=False, dtype="bf16", features=(), **kw):
    return Problem("bwd", dtype, 2, 2048, 2048, 16, 16, head_dim, causal, deterministic, features=features, **kw)


def heur(causal=False, dtype="bf16", **flags):
    return Sm90BwdConfig(64, 128, 2, 2, 128, dtype, causal, dq_writer=True, **flags)


def test_fields_names_template_encoding():
    plain = heur()
    names = {"dq_early": "_dqe", "s_ahead": "_sah", "q_rotate": "_rot", "dk_late": "_dqe_dkl"}
    for flag, suffix in names.items():
        cfg = plain.replace(**{flag: True}, **({"dq_early": True} if flag == "dk_late" else {}))
        assert cfg.name == plain.name + suffix and (cfg.problems() == []) == (flag != "s_ahead")
        assert FAM.decode(FAM.encode(cfg), "bf16", False) == cfg and flag not in FAM.encode(plain)
        # (s_ahead: refused, outside the tuning space: ptxas serializes every kernel it builds)
        assert FAM.space.get(flag) == (None if flag == "s_ahead" else (False, True))
    # appended after kDsDouble, kQRotate last: the existing configs keep their name expressions
    assert plain.kernel_name() == ("cuflash::sm90_bwd<64, 128, 2, 2, 128, cuflash::bf16, false, false, "
                                   "false, false, false, false, false, false, true>")
    tail = ", false, false, false, false"               # kVarlen, kLpt, kDynamic, kDsDouble
    assert plain.replace(dq_early=True).kernel_name() == plain.kernel_name()[:-1] + tail + ", false, true>"
    assert plain.replace(s_ahead=True).kernel_name() == plain.kernel_name()[:-1] + tail + ", true, false>"
    assert plain.replace(q_rotate=True).kernel_name() == plain.kernel_name()[:-1] + tail + ", false, false, true>"
    assert heur(True, dynamic=True).kernel_name().endswith(", false, false, true>")   # (kDsDouble omitted)
    assert plain.replace(dq_early=True, dk_late=True).kernel_name() == (plain.kernel_name()[:-1] + tail
                                                                        + ", false, true, false, true>")
    assert plain.replace(q_rotate=True, dq_early=True).template_args()[19:24] == (False, True, True, False, False)
    assert len(plain.template_args()) == 31   # (kRoles, kDqConvert, kDqFirst, kWideEpi, kDropPacked, kCapFold, then kDqTail last)
    # frag_pin (kFragPin) after kDkLate
    pin = plain.replace(frag_pin=True)
    assert pin.name == plain.name + "_pin" and pin.problems() == [] and FAM.space["frag_pin"] == (False, True)
    assert pin.kernel_name() == plain.kernel_name()[:-1] + tail + ", false, false, false, false, true>"
    assert pin.template_args()[-8] is True and FAM.decode(FAM.encode(pin), "bf16", False) == pin
    assert "frag_pin" not in FAM.encode(plain)
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    assert ("bool kDsDouble = false,\n          bool kSAhead = false, bool kDqEarly = false, bool kQRotate = false, "
            "bool kDkLate = false,\n          bool kFragPin = false, bool kRoles = false, bool kDqConvert = false, "
            "bool kDqFirst = false,\n          bool kWideEpi = false, int kDropPacked = 0, int kCapFold = 0, int kDqTail = 0>") in src
    # a point from before the flags gets them off
    point = {k: v for k, v in FAM.point(plain).items() if k not in FLAGS + ("frag_pin",)}
    assert FAM.make(point, problem()) == FAM.make(FAM.point(plain), problem())


def test_rules_and_for_problem():
    def why(cfg):
        return " ".join(cfg.problems())

    d256 = Sm90BwdConfig(64, 64, 2, 2, 256, "bf16", False)
    for flag in ("dq_early", "s_ahead"):
        assert "shared-keys" in why(d256.replace(**{flag: True}))
        assert "overlap_sdp" in why(heur(overlap_sdp=True, **{flag: True}))
        for feat in ("softcap", "alibi"):
            assert "softcap / ALiBi / dropout" in why(heur(**{flag: True, feat: True}))
    assert "q_rotate with causal" in why(heur(True, q_rotate=True))
    assert "q_rotate with causal" in why(heur(window=True, q_rotate=True))
    assert "q_rotate with causal" in why(Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False, True, q_rotate=True))
    for change in (dict(dq_early=True), dict(q_rotate=True), dict(dq_writer=False), dict(dtype="fp16")):
        assert "s_ahead with dq_early" in why(heur(s_ahead=True).replace(**change)), change
    assert "s_ahead with dq_early" in why(Sm90BwdConfig(128, 128, 2, 2, 64, "bf16", False, dq_writer=True,
                                                        s_ahead=True))
    assert "dk_late without dq_early" in why(heur(dk_late=True))
    assert "dk_late without dq_early" in why(heur(dk_late=True, dq_early=True).replace(dq_writer=False))
    assert "dk_late with dynamic" in why(heur(True, dynamic=True, dq_early=True, dk_late=True))
    assert Sm90BwdConfig(128, 128, 2, 2, 64, "bf16", False, dq_writer=True, dynamic=True, dq_early=True,
                         dk_late=True).problems() == []        # (d64's dynamic kernel fits)
    assert not FAM.for_problem(heur(True, dynamic=True, dq_early=True, dk_late=True), problem(causal=True)).dk_late
    got = FAM.for_problem(heur(True, ds_double=True, dq_early=True, dk_late=True), problem(causal=True))
    assert got.dk_late and got.problems() == []
    assert not FAM.for_problem(heur(dq_early=True, dk_late=True), problem(deterministic=True)).dk_late
    # allowed: dq_early with a window, deterministic, varlen, the dynamic scheduler, ds_double, fp16, d64
    for cfg in (heur(window=True, dq_early=True), heur(True, dynamic=True, ds_double=True, dq_early=True),
                Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", True, True, dq_early=True),
                heur(varlen=True, q_rotate=True, dq_early=True), heur(dtype="fp16", q_rotate=True, dynamic=True),
                Sm90BwdConfig(128, 128, 2, 2, 64, "bf16", False, dq_writer=True, dq_early=True, q_rotate=True),
                ):
        assert cfg.problems() == [], cfg.name
    # s_ahead: refused where it is otherwise built too (ptxas serializes its wgmmas, C7515)
    for cfg in (heur(s_ahead=True), heur(True, dynamic=True, s_ahead=True), heur(ds_double=True, s_ahead=True)):
        assert "s_ahead: ptxas serializes" in why(cfg), cfg.name
    # for_problem drops them where they are not built (a speed choice), keeps them elsewhere
    every = dict(dq_early=True, s_ahead=True, q_rotate=True)
    got = FAM.for_problem(heur(**every), problem())
    assert (got.dq_early, got.s_ahead, got.q_rotate) == (True, False, True) and got.problems() == []
    got = FAM.for_problem(heur(True, s_ahead=True, q_rotate=True), problem(causal=True))
    assert not got.s_ahead and not got.q_rotate and got.problems() == []
    got = FAM.for_problem(heur(**every), problem(features=("softcap",)))
    assert not (got.dq_early or got.s_ahead or got.q_rotate) and got.problems() == []
    got = FAM.for_problem(heur(s_ahead=True), problem(deterministic=True))
    assert not got.s_ahead and not got.dq_writer and got.problems() == []
    got = FAM.for_problem(heur(dtype="fp16", s_ahead=True), problem(dtype="fp16"))
    assert not got.s_ahead and got.problems() == []


def test_heuristic_switches(monkeypatch):
    # dropout's own speed rule (DROPOUT_FAST, session 27) off: this test's dropout rows check the rules before it
    # (test_bwd_feature_sched_cpu.py::test_dropout_alone_takes_dropout_fast checks the rule)
    monkeypatch.setattr(sm90_bwd, "DROPOUT_FAST", {})
    # as shipped: dk_late (with dq_early and ds_double, on the plain grid) for plain unordered d128
    # calls, dk_late with dq_early on d64's dynamic tile, measured; the rest off
    assert not (sm90_bwd.HEURISTIC_DQ_EARLY or sm90_bwd.HEURISTIC_S_AHEAD)
    assert sm90_bwd.HEURISTIC_Q_ROTATE == {(64, "fp16")}
    assert sm90_bwd.HEURISTIC_DK_LATE == {(128, False), (128, True), (64, False), (64, True)}
    for d, causal, det, dtype in itertools.product((64, 96, 128, 256), (False, True), (False, True), ("bf16", "fp16")):
        p = problem(d, causal, det, dtype)
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        late = d in (64, 96, 128) and not det
        assert (cfg.dq_early, cfg.dk_late) == (late, late) and not cfg.s_ahead, cfg.name
        assert cfg.q_rotate == (d == 64 and dtype == "fp16" and not causal and not det), cfg.name
        assert cfg.ds_double == (late and d != 64) and cfg.problems() == []
        assert cfg.dynamic == (d != 256 and not det), cfg.name
        assert cfg.frag_pin == (d in (96, 128) and not det), cfg.name
        for feats in (("window",), ("varlen",), ("softcap",)):
            pf = problem(d, causal, det, dtype, features=feats)
            if FAM.supports((9, 0), pf):
                continue
            cfg = FAM.for_problem(FAM.heuristic(pf), pf)
            # (but the feature sets of sm90_bwd.FEATURE_SCHED: the plain call's fields, dq_early and dk_late
            # among them; tests/test_bwd_feature_sched_cpu.py)
            sched = feats in sm90_bwd.FEATURE_SCHED.get((FAM.head_dim_of(d), dtype), ()) and not det
            assert (cfg.dq_early, cfg.dk_late) == (sched, sched), (feats, cfg.name)
            assert not (cfg.s_ahead or cfg.q_rotate), (feats, cfg.name)
    monkeypatch.setattr(sm90_bwd, "FEATURE_SCHED", {})
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_DK_LATE", frozenset())
    classes = frozenset(itertools.product((64, 128), (False, True)))
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_DQ_EARLY", classes)
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_S_AHEAD", frozenset(itertools.product((128,), (False, True), ("bf16",))))
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_Q_ROTATE", frozenset({64, 128}))
    for d, causal, det, dtype in itertools.product((64, 128, 256), (False, True), (False, True), ("bf16", "fp16")):
        p = problem(d, causal, det, dtype)
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        assert cfg.problems() == [], cfg.name
        assert cfg.q_rotate == (d != 256 and not causal and not det)
        assert not cfg.s_ahead     # (refused: HEURISTIC_S_AHEAD cannot switch it on)
        assert cfg.dq_early == (d != 256 and not det)
    # calls with features keep them off (unmeasured)
    for feats in (("window",), ("softcap",), ("dropout",)):
        p = problem(128, True, features=feats, dropout_p=0.1 if "dropout" in feats else 0.0)
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        assert not (cfg.dq_early or cfg.s_ahead or cfg.q_rotate) and cfg.problems() == []


def rotated(n_block, n_iters):
    """The Q blocks of K/V block n_block in kQRotate's order (the kernel's m_block_at)."""
    rot = n_block % n_iters if n_iters else 0
    return [(it + rot) - n_iters if it + rot >= n_iters else it + rot for it in range(n_iters)]


@pytest.mark.parametrize("n_iters", [1, 2, 5, 32, 33])
def test_rotation_is_a_permutation(n_iters):
    for n_block in range(3 * n_iters + 2):
        order = rotated(n_block, n_iters)
        assert sorted(order) == list(range(n_iters)) and order[0] == n_block % n_iters
    # the CTAs of a head start on distinct Q blocks (as many as there are Q blocks)
    assert len({rotated(n, n_iters)[0] for n in range(n_iters)}) == n_iters
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    assert "q_rot = n_iters > 0 ? n_block % n_iters : 0;" in src
    assert "const int m = it + q_rot;\n            return m >= n_iters ? m - n_iters : m;" in src


# (s_ahead's d128 kernels, off and never in a heuristic, are left out: with parse_ptxas counting
# ptxas' serialization infos they report serialized wgmmas; they must leave the tuning space)
ALLOWED = [heur(dq_early=True), heur(True, dynamic=True, dq_early=True),
           heur(q_rotate=True), heur(q_rotate=True, dq_early=True),
           heur(dtype="fp16", q_rotate=True, dynamic=True), heur(True, "fp16", dynamic=True, ds_double=True, dq_early=True),
           heur(dq_early=True, dk_late=True),
           heur(ds_double=True, dq_early=True, dk_late=True), heur(q_rotate=True, ds_double=True, dq_early=True, dk_late=True),
           Sm90BwdConfig(128, 128, 2, 2, 64, "fp16", True, dq_writer=True, dynamic=True, dq_early=True, dk_late=True),
           heur(True, "fp16", ds_double=True, dq_early=True, dk_late=True),
           Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", True, True, dq_early=True),          # deterministic (red.add)
           heur(True, window=True, dq_early=True),
           Sm90BwdConfig(128, 128, 2, 2, 64, "bf16", False, dq_writer=True, dynamic=True, dq_early=True, q_rotate=True)]


@needs_nvcc
def test_allowed_kernels_compile_clean():
    assert all(c.problems() == [] for c in ALLOWED)
    assert compile_clean(ALLOWED) == []


@needs_nvcc
def test_refused_s_ahead_kernels_spill():
    """The s_ahead mixes the config refuses do spill (nvcc 13.0): if one stops spilling, the rule can
    be widened."""
    refused = [heur(s_ahead=True, dq_early=True), heur(True, "fp16", s_ahead=True)]
    for cfg in refused:
        assert "s_ahead with dq_early" in " ".join(cfg.problems())
    reports = nvcc_compile(refused, "sm_90a", NVCC)
    assert all(r.spill_stores or r.spill_loads for r in reports), reports


def test_frag_pin_rules():
    """frag_pin: the head dim 64 / 128 tiles without softcap / ALiBi / dropout (refused elsewhere,
    dropped by for_problem); off in the heuristic until measured (HEURISTIC_FRAG_PIN)."""
    d256 = Sm90BwdConfig(64, 64, 2, 2, 256, "bf16", False, frag_pin=True)
    assert "frag_pin with the shared-keys tile" in " ".join(d256.problems())
    for feat in ("softcap", "alibi"):
        assert "frag_pin" in " ".join(heur(frag_pin=True, **{feat: True}).problems())
    for cfg in (heur(frag_pin=True), heur(True, frag_pin=True, dq_early=True, dk_late=True, ds_double=True),
                Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", True, True, frag_pin=True),
                Sm90BwdConfig(128, 128, 2, 2, 64, "fp16", True, dq_writer=True, dynamic=True, frag_pin=True)):
        assert cfg.problems() == [], cfg.name
    assert not FAM.for_problem(heur(frag_pin=True), problem(features=("softcap",))).frag_pin
    assert FAM.for_problem(heur(frag_pin=True), problem(deterministic=True)).frag_pin
    # dk_late with the dynamic scheduler at d128: built with frag_pin only (without, ptxas spills)
    dyn = heur(True, dynamic=True, ds_double=True, dq_early=True, dk_late=True)
    assert "dk_late with dynamic" in " ".join(dyn.problems()) and dyn.replace(frag_pin=True).problems() == []
    got = FAM.for_problem(dyn.replace(frag_pin=True), problem(causal=True))
    assert got.dk_late and got.dynamic and got.frag_pin
    assert not FAM.for_problem(dyn, problem(causal=True)).dk_late
    assert sm90_bwd.HEURISTIC_FRAG_PIN == {(128, False), (128, True)}   # (with dk_late and the dynamic scheduler)
    for d, causal in itertools.product((64, 128), (False, True)):
        assert FAM.heuristic(problem(d, causal)).frag_pin == (d == 128)
        assert not FAM.heuristic(problem(d, causal, deterministic=True)).frag_pin
        assert not FAM.heuristic(problem(d, causal, features=("window",), dtype="fp16")).frag_pin
        # (bf16 d128: FEATURE_SCHED's plain fields, frag_pin among them)
        assert FAM.heuristic(problem(d, causal, features=("window",))).frag_pin == (d == 128)


@needs_nvcc
def test_frag_pin_keeps_dv_one_group():
    """Without frag_pin ptxas (nvcc 13.0) injects a warpgroup.arrive (C7519) before each of dV's k16
    steps in session 15's d128 kernel (the plain grid); with it none, and no spills (the kernels of the timing's
    pin variants compile clean: tests/test_sm90_bwd_d128_cpu.py's other compile tests)."""
    import subprocess
    import tempfile
    from pathlib import Path

    from cuflash.compile import kernel_param_decl, render_source

    def log(cfg):
        lines = [render_source("sm90_bwd"), '#line 1 "instantiations"',
                 f"template __global__ void {cfg.kernel_name()}({kernel_param_decl(FAM, 'main', '')});"]
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "k.cu"
            src.write_text("\n".join(lines) + "\n")
            out = subprocess.run([NVCC, "-cubin", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v", "-o",
                                  str(Path(tmp) / "k.cubin"), str(src)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stderr + out.stdout

    p = problem(128, False)
    cfg = FAM.for_problem(FAM.heuristic(p), p).replace(frag_pin=False, dynamic=False)   # (session 15's kernel)
    assert "C7519" in log(cfg)
    pinned = log(cfg.replace(frag_pin=True))
    assert "C7519" not in pinned and "0 bytes spill stores, 0 bytes spill loads" in pinned


def test_bm80_rules():
    """BM 80 (kDqSwap, FA3's non-causal d128 tile): bf16, head dim 128, 2 consumers, dq_writer,
    non-causal plain unordered calls only; for_problem moves other calls to BM 64; outside the tuning
    space and the heuristic until its GPU tests and timing have run."""
    bm80 = heur().replace(BM=80)
    assert bm80.problems() == [] and bm80.name.startswith("sm90bwd_bf16_d128_full_BM80_BN128")
    assert bm80.replace(ds_double=True, dq_early=True, dk_late=True).problems() == []
    assert bm80.dq_cols == 64 and bm80.dq_writer_bufs == 1
    for change in (dict(causal=True), dict(dtype="fp16"), dict(frag_pin=True), dict(dq_writer=False),
                   dict(deterministic=True, dq_writer=False), dict(window=True), dict(softcap=True),
                   dict(dynamic=True), dict(q_rotate=True), dict(varlen=True)):
        assert "BM=80" in " ".join(bm80.replace(**change).problems()), change
    assert "BM must be 64 or 128" in " ".join(heur().replace(BM=96).problems())
    assert FAM.for_problem(bm80, problem()).BM == 80
    for p in (problem(causal=True), problem(deterministic=True), problem(dtype="fp16"),
              problem(features=("softcap",))):
        got = FAM.for_problem(bm80.replace(dtype=p.dtype, causal=p.causal), p)
        assert got.BM == 64 and got.problems() == [], got.name
    assert 80 not in FAM.space["BM"] and sm90_bwd.HEURISTIC_BM80 is False
    for causal in (False, True):
        assert FAM.heuristic(problem(causal=causal)).BM == 64


def test_heuristic_hooks(monkeypatch):
    """HEURISTIC_FRAG_PIN / HEURISTIC_BM80 / d128 in HEURISTIC_DYNAMIC, when switched on: frag_pin where
    built (dk_late then keeps the dynamic scheduler at d128), BM 80 for bf16 non-causal d128 plain calls
    (without frag_pin); every config valid."""
    classes = frozenset(itertools.product((64, 128), (False, True)))
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_FRAG_PIN", classes)
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_DYNAMIC", classes)
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_DK_LATE", classes)
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_BM80", True)
    monkeypatch.setattr(sm90_bwd, "FEATURE_SCHED", {})   # (features: the plain grid's own fields below)
    assert sm90_bwd.HEURISTIC_STAGES3 == frozenset()
    for d, causal, det, dtype in itertools.product((64, 128, 256), (False, True), (False, True), ("bf16", "fp16")):
        p = problem(d, causal, det, dtype)
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        assert cfg.problems() == [] and cfg.stages == 2, cfg.name
        bm80 = d == 128 and not causal and not det and dtype == "bf16"
        assert cfg.BM == (80 if bm80 else 128 if d == 64 else 64), cfg.name
        assert cfg.frag_pin == (d != 256 and not bm80 and not det), cfg.name
        assert cfg.dk_late == (d != 256 and not det) and cfg.dynamic == (d != 256 and not det and not bm80), cfg.name
        for feats in (("softcap",), ("window",)):
            pf = problem(d, causal, det, dtype, features=feats)
            if FAM.supports((9, 0), pf):
                continue
            cfg = FAM.for_problem(FAM.heuristic(pf), pf)
            assert cfg.problems() == [] and cfg.BM != 80 and not cfg.dk_late, (feats, cfg.name)


@needs_nvcc
def test_bm80_compiles_clean():
    """The BM 80 kernels of the timing script and the GPU tests (bf16, with and without the
    heuristic's dq_early / dk_late / ds_double): zero spills, no serialized wgmma."""
    cfgs = [heur().replace(BM=80), heur(ds_double=True, dq_early=True, dk_late=True).replace(BM=80)]
    assert compile_clean(cfgs) == []


@needs_nvcc
def test_frag_pin_kernels_compile_clean():
    """The frag_pin kernels of the timing and GPU tests at d128: the heuristic's with frag_pin, and dk_late
    with the dynamic scheduler (bf16 / fp16, causal or not): zero spills."""
    cfgs = [heur(c, dtype=dt, dynamic=True, ds_double=True, dq_early=True, dk_late=True, frag_pin=True)
            for c in (False, True) for dt in ("bf16", "fp16")]
    cfgs += [heur(True, ds_double=True, dq_early=True, dk_late=True, frag_pin=True)]
    assert compile_clean(cfgs) == []


def test_heuristic_stages3(monkeypatch):
    """HEURISTIC_STAGES3 switched on for fp16 non-causal d128: stages 3 there on the plain grid with the
    heuristic's other flags (one dq_writer tile), stages 2 elsewhere."""
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_STAGES3", frozenset({(128, False, "fp16")}))
    for d, causal, det, dtype in itertools.product((64, 128), (False, True), (False, True), ("bf16", "fp16")):
        p = problem(d, causal, det, dtype)
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        on = (d, causal, det, dtype) == (128, False, False, "fp16")
        assert cfg.stages == (3 if on else 2) and cfg.problems() == [], cfg.name
        assert not on or (cfg.dk_late and cfg.ds_double and cfg.dq_writer_bufs == 1 and not cfg.dynamic), cfg.name
