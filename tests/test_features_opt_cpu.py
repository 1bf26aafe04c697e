"""CPU checks of sm90_fwd's variants for calls with window / softcap / ALiBi (issue 12's
overheads): lazy_rescale (kLazyRescale) and fold_cap (kFoldCap, kernels_cu/softmax_fold.cuh) as
config fields (names, template arguments, rules, for_problem), the heuristic's module switches
(FEATURE_TILES, FEATURE_LAZY_RESCALE, SOFTCAP_FOLD), a float64 mirror of
the lazy rescale and of the folded softcap against the plain online softmax, and nvcc compile
checks (no spills) of the instantiations the switches can pick.
"""
import shutil

import numpy as np
import pytest

from cuflash import registry
from cuflash.families import sm90_fwd
from cuflash.families.sm90_fwd import Sm90FwdConfig
from cuflash.problem import Problem

FAM = registry.get("sm90_fwd")


def cfg(causal=True, BN=176, **kw):
    return Sm90FwdConfig(128, BN, 2, 2, True, False, 128, "bf16", causal).replace(**kw)


def prob(features=(), causal=True, **kw):
    vals = dict(softcap=30.0 if "softcap" in features else 0.0,
                window=(1024, 0) if "window" in features else (-1, -1),
                dropout_p=0.1 if "dropout" in features else 0.0)
    vals.update(kw)
    return Problem("fwd", "bf16", 2, 8192, 8192, 16, 16, 128, causal, features=tuple(sorted(features)), **vals)


# ---------------------------------------------------------------------------------------
# config fields

def test_plain_kernel_name_unchanged():
    c = cfg()
    assert not c.lazy_rescale and c.fold_cap == 0
    assert c.kernel_name() == ("cuflash::sm90_fwd<128, 176, 2, 2, true, false, 128, cuflash::bf16, "
                               "true, false, false, false>")
    assert "lazy_rescale" not in FAM.encode(c) and "fold_cap" not in FAM.encode(c)


def test_names_and_template_tail():
    c = cfg(softcap=True, lazy_rescale=True, fold_cap=2)
    assert c.name.endswith("_cap_lazy_fold2")
    assert c.kernel_name().endswith("true, false, true, false, false, 0, false, false, false, false, false, false, true, 2>")
    c = cfg(window=True, BN=128, lazy_rescale=True)
    assert c.name.endswith("_win_lazy")
    assert c.kernel_name().endswith("false, 0, false, false, false, false, false, false, true>")
    c = cfg(softcap=True, fold_cap=1)
    assert c.kernel_name().endswith("false, false, false, false, false, false, false, 1>")   # kVarlen, kPSmem, kTreeMax, kQDouble
    assert c.template_args()[-3:] == (False, 1, False)    # then kRescaleFirst
    # the ptxas report's mangled name parses back to the template arguments
    from cuflash.compile import _mangled_args
    mangled = ("_ZN7cuflash8sm90_fwdILi128ELi176ELi2ELi2ELb1ELb0ELi128ENS_4bf16ELb1ELb0ELb1ELb0ELb0ELi0ELb0"
               "ELb0ELb0ELb0ELb0ELb0ELb1ELi2ELb0EEEvNS_13Sm90FwdParamsE")   # (kRescaleFirst: false)
    assert _mangled_args(mangled) == cfg(softcap=True, lazy_rescale=True, fold_cap=2).template_args()


@pytest.mark.parametrize("kw, words", [
    (dict(fold_cap=1), "needs softcap"),
    (dict(softcap=True, fold_cap=4), "must be one of"),
    (dict(softcap=True, fold_cap=2), "needs lazy_rescale"),
    (dict(softcap=True, fold_cap=3), "needs lazy_rescale"),
    (dict(softcap=True, fold_cap=1, emu_exp2=1), "not with dropout or emu_exp2"),
    (dict(lazy_rescale=True, dropout=True, BN=128), "not with dropout or emu_exp2"),
    # main's d64 options (p_smem, tree_max, q_double) were not designed with the feature variants
    (dict(lazy_rescale=True, tree_max=True), "not designed together"),
    (dict(lazy_rescale=True, q_double=True), "not designed together"),
    (dict(softcap=True, fold_cap=1, q_double=True), "not designed together"),
    (dict(causal=False, head_dim=64, BM=192, consumers=3, BN=128, lazy_rescale=True, p_smem=True),
     "not designed together"),
])
def test_rules(kw, words):
    assert any(words in w for w in cfg(**kw).problems()), cfg(**kw).problems()


def test_for_problem_drops_what_the_call_cannot_take():
    c = cfg(softcap=True, fold_cap=2, lazy_rescale=True)
    # no softcap in the call: fold_cap off (lazy_rescale stays)
    got = FAM.for_problem(c, prob(("alibi",)))
    assert got.fold_cap == 0 and got.lazy_rescale and not got.softcap and got.alibi
    # dropout: both off
    got = FAM.for_problem(c.replace(BN=128), prob(("dropout",)))
    assert got.fold_cap == 0 and not got.lazy_rescale and got.dropout
    assert not got.problems()


# ---------------------------------------------------------------------------------------
# the heuristic's switches

def test_switches_off_keep_the_old_heuristic(monkeypatch):
    monkeypatch.setattr(sm90_fwd, "FEATURE_TILES", {})
    monkeypatch.setattr(sm90_fwd, "FEATURE_LAZY_RESCALE", False)
    monkeypatch.setattr(sm90_fwd, "SOFTCAP_FOLD", 0)
    for causal in (True, False):
        w = FAM.for_problem(FAM.heuristic(prob(("window",), causal)), prob(("window",), causal))
        assert (w.BN, w.persistent, w.dynamic, w.tma_store, w.lazy_rescale) == (128, True, False, False, False)
        c = FAM.for_problem(FAM.heuristic(prob(("softcap",), causal)), prob(("softcap",), causal))
        assert (c.BN, c.persistent, c.dynamic, c.fold_cap, c.emu_exp2) == (176, False, False, 0, 0)


@pytest.mark.parametrize("features", [("window",), ("softcap",), ("alibi",), ("softcap", "window"),
                                      ("alibi", "softcap", "window"), ("dropout",), ("alibi", "dropout")])
@pytest.mark.parametrize("causal", [True, False])
def test_switches_on(monkeypatch, features, causal):
    dyn = dict(persistent=True, dynamic=True, tma_store=True)
    monkeypatch.setattr(sm90_fwd, "FEATURE_TILES", {128: {"window": dict(BN=64, **dyn),
                                                          "softcap": dict(BN=144, **dyn),
                                                          "alibi": dict(BN=160, **dyn)}})
    monkeypatch.setattr(sm90_fwd, "FEATURE_LAZY_RESCALE", True)
    monkeypatch.setattr(sm90_fwd, "SOFTCAP_FOLD", 3)
    p = prob(features, causal)
    c = FAM.for_problem(FAM.heuristic(p), p)
    assert not c.problems(227 * 1024), c.problems()
    dropout = "dropout" in features
    assert c.lazy_rescale == (not dropout)
    assert c.fold_cap == (3 if "softcap" in features and not dropout else 0)
    # dropout alone: main's DROPOUT_DYNAMIC (the dynamic scheduler, not a feature switch of these)
    drop_dyn = features == ("dropout",) and sm90_fwd.HEURISTIC_DYNAMIC and sm90_fwd.DROPOUT_DYNAMIC
    assert c.dynamic == (not dropout or drop_dyn)
    assert c.persistent or (dropout and "window" not in features)
    if "dropout" in features:
        pass
    elif "window" in features:
        assert c.BN == 64
    elif "softcap" in features:
        assert c.BN == 144 and c.tma_store
    elif "alibi" in features:
        assert c.BN == 160
    if "dropout" in features:
        assert c.dynamic == drop_dyn and c.BN <= sm90_fwd.DROPOUT_BN[128]


def test_varlen_never_takes_the_dynamic_switch(monkeypatch):
    monkeypatch.setattr(sm90_fwd, "FEATURE_TILES", {128: {"softcap": dict(persistent=True, dynamic=True)}})
    p = prob(("softcap", "varlen"))
    c = FAM.for_problem(FAM.heuristic(p), p)
    assert not c.dynamic and not c.tma_store and c.varlen
    assert not c.problems()


# ---------------------------------------------------------------------------------------
# float64 mirrors of the arithmetic (softmax_fold.cuh)

def online(s_blocks, scale_log2, lazy, threshold=8.0):
    """(m, l, O-weights) of one row over blocks visited in order, as softmax_step_max does with
    O = Σ P·1 (the weights' sum stands for O: the rescale is what is checked)."""
    m, l, o = -np.inf, 0.0, 0.0
    for s in s_blocks:
        m_new = max(m, s.max())
        if lazy and not (m_new - m) * scale_log2 > threshold:
            m_new = m
        m_scaled = 0.0 if m_new == -np.inf else m_new * scale_log2
        alpha = np.exp2(m * scale_log2 - m_scaled)
        p = np.exp2(s * scale_log2 - m_scaled)
        assert p.max(initial=0) <= 2.0 ** threshold * (1 + 1e-12)
        l = l * alpha + p.sum()
        o = o * alpha + p.sum()
        m = m_new
    return m, l, o


def test_lazy_rescale_mirror_gives_the_same_softmax():
    rng = np.random.default_rng(0)
    scale_log2 = 128 ** -0.5 * np.log2(np.e)
    for spread in (1.0, 30.0, 300.0):
        blocks = [rng.standard_normal(176) * spread + 10 * spread * rng.standard_normal() for _ in range(9)]
        blocks[3][:7] = -np.inf
        m0, l0, _ = online(blocks, scale_log2, False)
        m1, l1, o1 = online(blocks, scale_log2, True)
        lse0 = m0 * scale_log2 + np.log2(l0)
        lse1 = m1 * scale_log2 + np.log2(l1)
        assert abs(lse0 - lse1) < 1e-9 and abs(o1 / l1 - 1) < 1e-12
    # a row masked in its first blocks: m stays -inf without NaN
    m, l, _ = online([np.full(8, -np.inf), np.array([1.0, 2.0])], scale_log2, True)
    assert m == 2.0 and np.isfinite(l)


def test_folded_softcap_is_the_same_exponent():
    rng = np.random.default_rng(1)
    scale, cap = 128 ** -0.5, 30.0
    s = rng.standard_normal(1000) * 400
    scale_log2 = scale * np.log2(np.e)
    plain = (cap / scale) * np.tanh(s * scale / cap) * scale_log2
    t = np.tanh(s * (scale / cap))
    folded = t * (scale_log2 * (cap / scale))
    assert np.allclose(plain, folded, rtol=1e-12, atol=1e-12)
    # the max of t is tanh of the raw max (tanh is increasing), the LSE's scale softcap
    assert np.tanh(s.max() * scale / cap) == t.max()
    assert np.isclose(scale * (cap / scale), cap)


def test_fixed_max_bound():
    f = sm90_fwd.softcap_fixed_m
    assert f(prob(("softcap",), softcap=30.0)) == 1.0
    assert f(prob(("softcap",), softcap=34.6)) == 1.0      # 2 · 34.6 · log2(e) = 99.8
    assert f(prob(("softcap",), softcap=34.7)) == 2.0
    assert f(prob(("softcap",), softcap=50.0)) == 2.0      # Gemma 2's attention cap: the row max
    assert f(prob(("window",))) == 2.0
    # the params carry it only for fold_cap 3
    p = prob(("softcap",))
    fields = FAM.static_params(cfg(softcap=True, fold_cap=3, lazy_rescale=True), p, _strides(p), {},
                               128 ** -0.5, 132)
    assert fields["softcap_fixed_m"] == 1.0
    fields = FAM.static_params(cfg(softcap=True, fold_cap=2, lazy_rescale=True), p, _strides(p), {},
                               128 ** -0.5, 132)
    assert fields["softcap_fixed_m"] == 2.0


def _strides(p):
    row = p.nheads * p.head_dim
    st = (p.seqlen_q * row, row, p.head_dim, 1)
    return {"q": st, "k": st, "v": st, "o": st}


def test_fixed_max_mirror():
    """P = exp2(k (t - 1)) with the fixed max 1 (t units) gives the softmax of the capped scores,
    and no P underflows at the bound (2k <= 100)."""
    rng = np.random.default_rng(2)
    for cap in (5.0, 30.0, 34.6):
        k = cap * np.log2(np.e)
        t = np.tanh(rng.standard_normal(4000) * 300 / cap)
        t[:3] = -1.0
        p = np.exp2(k * (t - 1))
        assert p.min() >= 2.0 ** -100 and p.max() <= 1
        ref = np.exp(cap * t - (cap * t).max())
        assert np.allclose(p / p.sum(), ref / ref.sum(), rtol=1e-10, atol=0)
        lse = 1 * cap + np.log(p.sum())                  # m · (softmax_scale · softcap_out) + log l
        assert np.isclose(lse, np.log(np.exp(cap * t).sum()))


# ---------------------------------------------------------------------------------------
# compile checks

NVCC_CONFIGS = [
    cfg(True, 128, persistent=True, dynamic=True, tma_store=True, window=True, lazy_rescale=True),
    cfg(False, 176, softcap=True, fold_cap=2, lazy_rescale=True),
    cfg(True, 176, softcap=True, fold_cap=1),
    cfg(False, 160, persistent=True, dynamic=True, tma_store=True, alibi=True, lazy_rescale=True),
    cfg(True, 128, persistent=True, window=True, softcap=True, alibi=True, fold_cap=1, lazy_rescale=True),
]


def _ptxas_log(configs, arch="sm_90a"):
    """nvcc -Xptxas -v's whole output for one cubin of `configs` (sm90_fwd): PtxasReport drops the
    'ptxas info' lines, among them C7520 (every wgmma serialized)."""
    import subprocess
    import tempfile
    from pathlib import Path

    from cuflash.compile import kernel_param_decl, render_source

    lines = [render_source("sm90_fwd"), '#line 1 "instantiations"']
    lines += [f"template __global__ void {c.kernel_name()}({kernel_param_decl(FAM)});" for c in configs]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "sm90_fwd.cu"
        src.write_text("\n".join(lines) + "\n")
        proc = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v",
                               "-o", str(Path(tmp) / "out.cubin"), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr + proc.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_variants_compile_without_spills():
    """No spill, no ptxas warning and no serialized wgmma (C7510-C7515 warnings, C7520 info: a
    wgmma under a branch ptxas cannot prove uniform serializes every wgmma of the kernel; a
    per-warpgroup half-block skip of the window's edge blocks was dropped for that reason)."""
    from cuflash.compile import parse_ptxas

    log = _ptxas_log(NVCC_CONFIGS)
    reports = parse_ptxas(log)
    assert len(reports) == len(NVCC_CONFIGS)
    for r in reports:
        assert r.spill_stores == 0 and r.spill_loads == 0, r
        assert not r.warnings, r.warnings
    assert "C7520" not in log and "serialized" not in log, [l for l in log.splitlines() if "C75" in l]
