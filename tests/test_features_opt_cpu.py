"""CPU checks of sm90_fwd's variants for calls with window / softcap / ALiBi (issue 12's
overheads): lazy_rescale (kLazyRescale) and fold_cap (kFoldCap, kernels_cu/softmax_fold.cuh) as
config fields (names, template arguments, rules, for_problem), the heuristic's module switches
(FEATURE_TILES, FEATURE_LAZY_RESCALE, SOFTCAP_FOLD), a float64 mirror of
the lazy rescale and of the folded softcap against the plain online softmax, and nvcc compile
checks (no spills) of the instantiations the switches can pick.
"""
import math
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
    assert c.template_args()[-14:] == (False, 1, False, False, False, False, 0, False, False, 0, 0, False, False, False)   # kLazyRescale, kFoldCap, kAlibiLinear, kRescaleFirst, kTileOverlap, kDropPacked, kDropEarly, kStreamTail, kPvOverlap, kMaskedCopy, kRagKeys, kPrefetch, kSAhead, kDeferMax
    # the ptxas report's mangled name parses back to the template arguments
    from cuflash.compile import _mangled_args
    mangled = ("_ZN7cuflash8sm90_fwdILi128ELi176ELi2ELi2ELb1ELb0ELi128ENS_4bf16ELb1ELb0ELb1ELb0ELb0ELi0ELb0"
               "ELb0ELb0ELb0ELb0ELb0ELb1ELi2ELb0ELb0ELb0ELb0ELi0ELb0ELb0ELi0ELi0ELb0ELb0ELb0EEEvNS_13Sm90FwdParamsE")   # (kAlibiLinear, kRescaleFirst, kTileOverlap, kDropPacked: false; kDropEarly 0; kStreamTail, kPvOverlap false; kMaskedCopy 0; kRagKeys 0; kPrefetch, kSAhead, kDeferMax false)
    assert _mangled_args(mangled) == cfg(softcap=True, lazy_rescale=True, fold_cap=2).template_args()


@pytest.mark.parametrize("kw, words", [
    (dict(fold_cap=1), "needs softcap"),
    (dict(softcap=True, fold_cap=5), "must be one of"),
    (dict(softcap=True, fold_cap=4, lazy_rescale=True, dtype="fp16"), "bf16 only"),
    (dict(softcap=True, fold_cap=4), "needs lazy_rescale"),
    (dict(softcap=True, fold_cap=2), "needs lazy_rescale"),
    (dict(softcap=True, fold_cap=3), "needs lazy_rescale"),
    (dict(softcap=True, lazy_rescale=True, emu_exp2=1), "emu_exp2 only with fold_cap"),
    (dict(lazy_rescale=True, dropout=True, BN=128), "run without dropout"),
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
    monkeypatch.setattr(sm90_fwd, "WINDOW_TILE_OVERLAP", {})
    monkeypatch.setattr(sm90_fwd, "FEATURE_LAZY_RESCALE", False)
    monkeypatch.setattr(sm90_fwd, "SOFTCAP_FOLD", {})
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
    monkeypatch.setattr(sm90_fwd, "SOFTCAP_FOLD", {128: 3})
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


# The shipped switches (the measured defaults, sm90_fwd FEATURE_TILES' note): bf16 d128 8k
SHIPPED = {
    # (session 21: the static persistent schedule with tile_overlap, WINDOW_TILE_OVERLAP)
    (("window",), True): "sm90fwd_bf16_d128_causal_BM128_BN128_s2_c2_pp_persist_tmao_win_tov",
    (("window",), False): "sm90fwd_bf16_d128_full_BM128_BN128_s2_c2_pp_persist_tmao_win_tov",
    (("softcap",), True): "sm90fwd_bf16_d128_causal_BM128_BN128_s2_c2_pp_persist_dyn_tmao_cap_lazy_fold3_mcp1",
    (("softcap",), False): "sm90fwd_bf16_d128_full_BM128_BN144_s2_c2_pp_persist_dyn_tmao_cap_lazy_fold3_mcp1",
    (("alibi",), True): "sm90fwd_bf16_d128_causal_BM128_BN176_s2_c2_pp_persist_dyn_alibi_alin",
    # (session 16: BN 160 + TMA store, FEATURE_TILES "alibi:full")
    (("alibi",), False): "sm90fwd_bf16_d128_full_BM128_BN160_s2_c2_pp_persist_dyn_tmao_alibi_alin",
}


@pytest.mark.parametrize("features, causal", list(SHIPPED), ids=lambda x: str(x))
def test_shipped_switches(features, causal):
    p = prob(features, causal)
    c = FAM.for_problem(FAM.heuristic(p), p)
    assert c.name == SHIPPED[features, causal]
    assert not c.problems(227 * 1024)
    # 16k keys and more: no TMA store (as the plain call's)
    p = p.replace(seqlen_q=16384, seqlen_k=16384)
    assert not FAM.for_problem(FAM.heuristic(p), p).tma_store


@pytest.mark.parametrize("d", [64, 96, 192, 256])
@pytest.mark.parametrize("features", [("window",), ("softcap",), ("alibi",), ("softcap", "window")])
def test_other_head_dims_keep_their_configs(monkeypatch, d, features):
    """The switches are per head dim: only d128 was measured."""
    p = prob(features, True).replace(head_dim=d)
    now = FAM.for_problem(FAM.heuristic(p), p)
    monkeypatch.setattr(sm90_fwd, "FEATURE_TILES", {})
    monkeypatch.setattr(sm90_fwd, "SOFTCAP_FOLD", {})
    assert FAM.for_problem(FAM.heuristic(p), p) == now
    assert now.fold_cap == 0 and not now.dynamic


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


def test_heuristic_folds_3_in_both_dtypes():
    """fold_cap 3 (session 19; fold 4 refused: its LSE is not the backward's)."""
    for dtype in ("fp16", "bf16"):
        p = prob(("softcap",)).replace(dtype=dtype)
        c = FAM.for_problem(FAM.heuristic(p), p)
        assert c.fold_cap == 3 and not c.problems(227 * 1024)
        assert c.ones_bytes == 256 and c.smem_bytes == c.replace(fold_cap=1).smem_bytes + 256


def test_fold4_fields(monkeypatch):
    c = cfg(softcap=True, fold_cap=4, lazy_rescale=True)
    assert any("FOLD4_TIMING" in m for m in c.problems())
    monkeypatch.setattr(sm90_fwd, "FOLD4_TIMING", True)
    assert c.name.endswith("_cap_lazy_fold4") and not c.problems()
    assert c.kernel_name().endswith("true, 4>")
    p = prob(("softcap",))
    assert FAM.static_params(c, p, _strides(p), {}, 128 ** -0.5, 132)["softcap_fixed_m"] == 1.0


def test_fixed_max_bound():
    f = sm90_fwd.softcap_fixed_m
    assert f(prob(("softcap",), softcap=30.0)) == 1.0
    assert f(prob(("softcap",), softcap=34.6)) == 1.0      # 2 · 34.6 · log2(e) = 99.8
    # past 100: the fixed max below 1 by a / k (k = softcap·log2(e), a = 2k - 100 <= FIXED_MAX_LOG2_TOP), so that
    # P spans [2^-100, 2^a]
    k = 50.0 * math.log2(math.e)
    assert f(prob(("softcap",), softcap=50.0)) == pytest.approx(1 - (2 * k - 100) / k)   # Gemma 2's cap
    assert 0.38 < f(prob(("softcap",), softcap=50.0)) < 0.39 and f(prob(("softcap",), softcap=34.7)) < 1.0
    assert f(prob(("softcap",), softcap=55.4)) < 1.0       # a = 59.9
    assert f(prob(("softcap",), softcap=55.5)) == 2.0      # a = 60.2: the row max
    assert f(prob(("window",))) == 2.0
    # fp16: P (fp16 into the P V GEMM) stays normal only while 2k <= 14 (FIXED_MAX_LOG2_RANGE_FP16)
    assert f(prob(("softcap",), softcap=30.0).replace(dtype="fp16")) == 2.0
    assert f(prob(("softcap",), softcap=4.8).replace(dtype="fp16")) == 1.0     # 2 · 4.8 · log2(e) = 13.9
    assert f(prob(("softcap",), softcap=4.9).replace(dtype="fp16")) == 2.0
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


def fixed_max_forward(s, v, cap, scale, elem, rounded_l):
    """One query row of sm90_fwd's folded softcap with the fixed max (kFoldCap 3 / 4), float64
    with the kernel's roundings: P = exp2(k (t - 1)) rounded to `elem` for the P V GEMM (fp32
    products of 16-bit numbers: exact in float64), O = Σ P̃ V / l rounded to `elem` with l the sum of
    the fp32 P (before session 18) or of the rounded P (lr, softmax_fold.cuh add_rounded; the LSE
    keeps the fp32 P's sum)."""
    k = cap * np.log2(np.e)          # softcap_out · scale_log2
    t = np.tanh(s * scale / cap)
    p = np.exp2(k * (t - 1)).astype(np.float32)
    p16 = p.astype(elem).astype(np.float64)
    l = p16.sum() if rounded_l else p.astype(np.float64).sum()
    return ((p16 @ v) / l).astype(elem)


@pytest.mark.parametrize("dtype,cap", [("bfloat16", 30.0), ("bfloat16", 5.0), ("float16", 4.0)])
def test_fixed_max_rounded_l_mirror(dtype, cap):
    """With l from the rounded P, O is a convex combination of V's rows: at one key O = V bit for bit
    (the fp32 P's l left O = V·P̃/P, off by up to 2^-9 in bf16: the GPU tests' dQ errors at
    seqlen_k = 1); at a few keys its error stays within 2x plain attention's in the same precision
    (softmax in fp32, P / l rounded, as test_features_gpu.feature_attention)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    elem = getattr(ml_dtypes, dtype) if dtype == "bfloat16" else np.float16
    rng = np.random.default_rng(3)
    scale = 128 ** -0.5
    off = 0
    for _ in range(200):
        s = rng.standard_normal(1) * 30
        v = rng.standard_normal((1, 128)).astype(elem).astype(np.float64)
        new = fixed_max_forward(s, v, cap, scale, elem, True)
        assert (new.astype(np.float64) == v).all()
        off += int((fixed_max_forward(s, v, cap, scale, elem, False).astype(np.float64) != v).any())
    assert off > 20    # the old l: many draws leave O != V (~30% of rows of 128 bf16 elements)
    for n in (2, 17, 113):
        errs, base = [], []
        for _ in range(20):
            s = (rng.standard_normal(n) * 11.3).astype(elem).astype(np.float64)   # bf16 scores
            v = rng.standard_normal((n, 128)).astype(elem).astype(np.float64)
            z = cap * np.tanh(s * scale / cap)
            ref = np.exp(z - z.max()) / np.exp(z - z.max()).sum() @ v
            p = np.exp((z - z.max()).astype(np.float32))
            low = ((p / p.sum()).astype(elem).astype(np.float64) @ v).astype(elem)
            errs.append(np.abs(fixed_max_forward(s, v, cap, scale, elem, True) - ref).max())
            base.append(np.abs(low.astype(np.float64) - ref).max())
        floor = float(ml_dtypes.finfo(elem).eps) * np.abs(v).max()
        assert max(errs) <= 2 * max(base) + floor, (n, max(errs), max(base))


# ---------------------------------------------------------------------------------------
# compile checks

NVCC_CONFIGS = [
    cfg(True, 128, persistent=True, dynamic=True, tma_store=True, window=True, lazy_rescale=True),
    cfg(False, 176, softcap=True, fold_cap=2, lazy_rescale=True),
    cfg(True, 176, softcap=True, fold_cap=1),
    cfg(False, 160, persistent=True, dynamic=True, tma_store=True, alibi=True, lazy_rescale=True),
    cfg(True, 128, persistent=True, window=True, softcap=True, alibi=True, fold_cap=1, lazy_rescale=True),
    # fold_cap 3, causal: the softcap heuristic's tile (the fixed max's row sum on the tensor cores)
    cfg(True, 128, persistent=True, dynamic=True, tma_store=True, softcap=True, fold_cap=3, lazy_rescale=True),
    # alibi_lin: the timing's candidates and the window's tile
    cfg(True, 176, persistent=True, dynamic=True, alibi=True, alibi_lin=True),
    cfg(False, 176, alibi=True, alibi_lin=True),
    cfg(False, 128, persistent=True, dynamic=True, tma_store=True, window=True, alibi=True, alibi_lin=True),
    # ALiBi full's shipped tile since session 16
    cfg(False, 160, persistent=True, dynamic=True, tma_store=True, alibi=True, alibi_lin=True),
    # fold_cap 3 at the softcap heuristic's full tile, and BN 160 (tests/softcap_fixed_timing.py's bn160@full)
    cfg(False, 144, persistent=True, dynamic=True, tma_store=True, softcap=True, fold_cap=3, lazy_rescale=True),
    cfg(False, 160, persistent=True, dynamic=True, tma_store=True, softcap=True, fold_cap=3, lazy_rescale=True),
    # masked_copy (session 21): the softcap heuristic's tiles, bf16 causal / full (and full with emu_exp2 1)
    # and fp16 causal with the fixed-max step's copy, fp16 full with the row-max step's too
    cfg(True, 128, persistent=True, dynamic=True, tma_store=True, softcap=True, fold_cap=3, lazy_rescale=True,
        masked_copy=1),
    cfg(False, 144, persistent=True, dynamic=True, tma_store=True, softcap=True, fold_cap=3, lazy_rescale=True,
        masked_copy=1),
    cfg(False, 144, persistent=True, dynamic=True, tma_store=True, softcap=True, fold_cap=3, lazy_rescale=True,
        emu_exp2=1, masked_copy=1),
    cfg(True, 128, persistent=True, dynamic=True, tma_store=True, softcap=True, fold_cap=3, lazy_rescale=True,
        masked_copy=1, dtype="fp16"),
    cfg(False, 144, persistent=True, dynamic=True, tma_store=True, softcap=True, fold_cap=3, lazy_rescale=True,
        masked_copy=2, dtype="fp16"),
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


def _default_configs():
    """The heuristic's configs at d128 with the shipped switches (both masks; window, softcap, ALiBi
    and their pairs / triple), forward and backward, for the no-spill check."""
    fwd, bwd = [], []
    BWD = registry.get("sm90_bwd")
    for features in (("window",), ("softcap",), ("alibi",), ("softcap", "window"), ("alibi", "window"),
                     ("alibi", "softcap"), ("alibi", "softcap", "window")):
        for causal in (True, False):
            p = prob(features, causal)
            fwd.append(FAM.for_problem(FAM.heuristic(p), p))
            pb = p.replace(op="bwd")
            bwd.append(BWD.for_problem(BWD.heuristic(pb), pb))
    return list(dict.fromkeys(fwd)), list(dict.fromkeys(bwd))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_shipped_defaults_compile_without_spills():
    """Every d128 forward the switches give a call with features (14), and the window backward of
    WINDOW_BWD (with the pairs' backwards): no spill, no stack (nvcc 13.0, sm_90a; ~1 min on
    2 cores). Also the window backward at stages 3 (WINDOW_BWD's former choice)."""
    from concurrent.futures import ThreadPoolExecutor

    from cuflash.compile import nvcc_compile

    fwd, bwd = _default_configs()
    bwd.append(bwd[0].replace(stages=3, dynamic=False, ds_double=False, dq_early=False, dk_late=False, frag_pin=False,
                              dq_tail=0))   # (dq_tail: the dynamic scheduler's)
    assert bwd[0].dynamic and bwd[0].ds_double and bwd[0].window
    jobs = [fwd[i:i + 4] for i in range(0, len(fwd), 4)] + [bwd[i:i + 4] for i in range(0, len(bwd), 4)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = [r for rs in pool.map(lambda c: nvcc_compile(c, "sm_90a"), jobs) for r in rs]
    cfgs = [c for chunk in jobs for c in chunk]
    bad = [f"{c.name}: {r}" for c, r in zip(cfgs, reports)
           if r.spill_stores or r.spill_loads or r.stack_bytes
           or any("C751" in w or "serialized" in w for w in r.warnings)]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------
# alibi_lin (kAlibiLinear: ALiBi's bias as one FFMA per score, softmax_fold.cuh AlibiLinear)

def test_alibi_lin_field():
    c = cfg(alibi=True, alibi_lin=True)
    assert c.name.endswith("_alibi_alin") and not c.problems()
    assert c.kernel_name().endswith("false, false, false, false, false, false, false, 0, true>")
    assert "alibi_lin" not in FAM.encode(cfg(alibi=True)) and "alibi_lin=1" in FAM.encode(c)
    assert FAM.decode(FAM.encode(c), "bf16", True).replace(alibi=True) == c   # (the call sets alibi)
    for kw in (dict(alibi_lin=True), dict(alibi=True, softcap=True, alibi_lin=True),
               dict(alibi=True, dropout=True, BN=128, alibi_lin=True), dict(alibi=True, varlen=True, alibi_lin=True)):
        assert any("alibi_lin is ALiBi's bias alone" in w for w in cfg(**kw).problems()), kw
    # for_problem: ALiBi alone or with a window keeps it, any other feature drops it
    assert FAM.for_problem(c, prob(("alibi",))).alibi_lin
    assert FAM.for_problem(c.replace(BN=128), prob(("alibi", "window"))).alibi_lin
    for feats in (("alibi", "softcap"), ("softcap",), ("alibi", "dropout")):
        assert not FAM.for_problem(c.replace(BN=128), prob(feats)).alibi_lin, feats


def test_alibi_lin_switch(monkeypatch):
    p = prob(("alibi",), True)
    assert FAM.for_problem(FAM.heuristic(p), p).alibi_lin              # on as shipped (measured)
    monkeypatch.setattr(sm90_fwd, "ALIBI_LINEAR", frozenset())
    assert not FAM.for_problem(FAM.heuristic(p), p).alibi_lin
    monkeypatch.setattr(sm90_fwd, "ALIBI_LINEAR", frozenset({(128, True)}))
    assert FAM.for_problem(FAM.heuristic(p), p).alibi_lin
    for q in (prob(("alibi",), False), prob(("alibi", "softcap"), True), prob(("alibi", "dropout"), True)):
        assert not FAM.for_problem(FAM.heuristic(q), q).alibi_lin
    q = prob(("alibi", "window"), True)
    c = FAM.for_problem(FAM.heuristic(q), q)
    assert c.alibi_lin and not c.problems(227 * 1024)


def alibi_linear_mirror(s, rows, key0, offset, slope, sigma):
    """float64 mirror of AlibiLinear::apply + softmax_step_shift's exponent for one thread's
    elements (columns c = 0..n-1 from key0): the true biased scores."""
    c = np.arange(s.shape[1])
    if sigma:
        r = rows[:, None] + offset - key0
        shifted = s + sigma * slope * c[None, :]
        shift = -sigma * slope * r
        return shifted + shift
    return s - slope * np.abs(rows[:, None] + offset - key0 - c[None, :])


@pytest.mark.parametrize("offset", [0, 37, -300])
def test_alibi_linear_mirror(offset):
    """Where AlibiLinear::side says a block is on one side of a warp's diagonals, the linear form
    equals the exact bias; causal blocks take +1 and differ only right of the diagonal (masked)."""
    rng = np.random.default_rng(3)
    slope, BN = 0.37, 128

    def side(row0, key0):
        if key0 + BN - 1 <= row0 + offset:
            return 1
        if key0 >= row0 + 15 + offset:
            return -1
        return 0

    for row0 in (0, 16, 512, 1008):
        rows = row0 + np.arange(16)
        for key0 in range(0, 2048, BN):
            s = rng.standard_normal((16, BN))
            exact = alibi_linear_mirror(s, rows, key0, offset, slope, 0)
            sg = side(row0, key0)
            assert np.allclose(alibi_linear_mirror(s, rows, key0, offset, slope, sg), exact, atol=1e-9)
            lin = alibi_linear_mirror(s, rows, key0, offset, slope, 1)      # causal: σ = +1 always
            visible = (key0 + np.arange(BN))[None, :] <= rows[:, None] + offset
            assert np.allclose(lin[visible], exact[visible], atol=1e-9)
