"""CPU tests of the window / softcap / ALiBi features that need no GPU: the band mask's block
ranges (mask.cuh BandMask, compiled for the host with g++ and checked against the
element-wise rule by brute force), selection and the config flags."""
import shutil
import subprocess

import pytest

from cuflash import registry
from cuflash.compile import kernel_dir
from cuflash.problem import Problem
from cuflash.select import choose

MASK_CHECK = r"""
#include <algorithm>
#include <cstdio>
using std::min; using std::max;
#define __device__
#define __forceinline__ inline
#define __uint_as_float(x) 0.f
#include "mask.cuh"
using namespace cuflash;
template <bool C, bool W, int kBr, int kBc>
int check(int sq, int sk, int left, int right) {
    BandMask<C, W> m(sq, sk, left, right);
    auto vis = [&](int i, int j) { float x = 0; m.apply(x, i, j, 1.f); return x == 0; };
    int bad = 0;
    int mb = (sq + kBr - 1) / kBr, nb = (sk + kBc - 1) / kBc;
    for (int b = 0; b < mb; ++b) {
        int r0 = b * kBr;
        int lo = m.template kv_block_begin<kBr, kBc>(r0), hi = m.template kv_block_end<kBr, kBc>(r0);
        for (int n = 0; n < nb; ++n) {
            bool any = false, hidden = false;
            for (int i = r0; i < r0 + kBr; ++i) for (int j = n * kBc; j < n * kBc + kBc; ++j) {
                bool v = i < sq && vis(i, j);  // rows past sq: don't care for "any"
                if (i < sq) { any |= v; if (!v) hidden = true; }
            }
            bool in = n >= lo && n < hi;
            if (any && !in) { bad++; printf("fwd miss b%d n%d\n", b, n); }
            // needs_mask must be true whenever a real row hides something in a visited block
            if (in && hidden && !m.template needs_mask<kBc, kBr>(r0, n)) { bad++; printf("needs_mask b%d n%d\n", b, n); }
        }
    }
    for (int n = 0; n < nb; ++n) {
        int k0 = n * kBc;
        int lo = m.template q_block_begin<kBr>(k0), hi = m.template q_block_end<kBr, kBc>(k0, mb);
        for (int b = 0; b < mb; ++b) {
            bool any = false;
            for (int i = b * kBr; i < min(sq, b * kBr + kBr); ++i) for (int j = k0; j < k0 + kBc; ++j) any |= vis(i, j);
            bool in = b >= lo && b < hi;
            if (any && !in) { bad++; printf("bwd miss n%d b%d\n", n, b); }
            // deterministic turns: Q block b's visiting K/V blocks start at kv_block_begin
            if (in && n < m.template kv_block_begin<kBr, kBc>(b * kBr)) { bad++; printf("turn n%d b%d\n", n, b); }
        }
    }
    // deterministic dQ turns: the K/V blocks visiting Q block b are exactly the contiguous
    // [kv_block_begin(b), ...) (turn = kv_index - first)
    for (int b = 0; b < mb; ++b) {
        int first = m.template kv_block_begin<kBr, kBc>(b * kBr), expect = first;
        for (int n = 0; n < nb; ++n) {
            int k0 = n * kBc;
            bool visits = b >= m.template q_block_begin<kBr>(k0) && b < m.template q_block_end<kBr, kBc>(k0, mb);
            if (visits) { if (n != expect) { bad++; printf("turn gap b%d n%d\n", b, n); } expect = n + 1; }
        }
    }
    // the tile form of apply agrees with the element form (mma C layout, one warp's 16 rows)
    for (int q0 = 0; q0 < sq; q0 += 16)
        for (int k0 = 0; k0 < sk; k0 += 16)
            for (int g = 0; g < 8; ++g) for (int t = 0; t < 4; ++t) {
                float acc[1][2][4] = {};
                m.apply(acc, q0, k0, g, t, 1.f);
                for (int nt = 0; nt < 2; ++nt) for (int e = 0; e < 4; ++e) {
                    float x = 0;
                    m.apply(x, q0 + g + 8 * (e / 2), k0 + nt * 8 + 2 * t + e % 2, 1.f);
                    if (x != acc[0][nt][e]) { bad++; printf("tile q%d k%d\n", q0, k0); }
                }
            }
    // elementwise tile apply vs single apply
    return bad;
}
int main() {
    int seq[] = {1, 17, 64, 113, 200};
    int wins[] = {-1, 0, 1, 5, 63, 64, 100, 300};
    int bad = 0, n = 0;
    for (int sq : seq) for (int sk : seq) for (int l : wins) for (int r : wins) {
        bad += check<false, true, 64, 32>(sq, sk, l, r);
        bad += check<true, true, 64, 32>(sq, sk, l, r);
        bad += check<false, true, 32, 64>(sq, sk, l, r);
        bad += check<true, false, 128, 64>(sq, sk, l, r);
        bad += check<false, false, 16, 16>(sq, sk, l, r);
        n += 5;
    }
    printf("%d cases, %d bad\n", n, bad);
    return bad != 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the host check")
def test_band_mask_block_ranges_match_the_element_rule(tmp_path):
    """For every (seqlen_q, seqlen_k, left, right, causal) of a grid: the forward's K/V block range
    and the backward's Q block range hold every visible element, needs_mask is true on every
    block that hides one, the deterministic dQ turns count from kv_block_begin without gaps, and
    the tile form of apply agrees with the element form."""
    src = tmp_path / "mask_check.cpp"
    src.write_text(MASK_CHECK)
    exe = tmp_path / "mask_check"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{kernel_dir()}", str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-2000:]
    assert res.stdout.strip().endswith(", 0 bad")


def problem(op="fwd", d=64, features=(), causal=False, **kw):
    return Problem(op, "bf16", 2, 300, 200, 8, 2, d, causal, features=tuple(sorted(features)), **kw)


def without_sm90_bwd_paths(cfg, name, kname):
    """sm90_bwd's name and kernel name without what follows its feature flags (the dQ-path /
    schedule suffixes _dqb _ovl _dqw; the template arguments dropout, dq_bulk, overlap_sdp,
    dq_writer, present when one of them is set)."""
    if cfg.family != "sm90_bwd":
        return name, kname
    for sfx in ("_dqw", "_ovl", "_dqb"):
        name = name.removesuffix(sfx)
    if cfg.dq_bulk or cfg.overlap_sdp or cfg.dq_writer:
        # (the schedule and main-loop flags after them too: BM .. alibi are the first 11 arguments)
        head, args = kname.split("<", 1)
        kname = head + "<" + ", ".join(args[:-1].split(", ")[:11]) + ">"
    return name, kname


@pytest.mark.parametrize("arch,fwd,bwd", [((8, 0), "fa2_fwd", "fa2_bwd"), ((9, 0), "sm90_fwd", "sm90_bwd")])
@pytest.mark.parametrize("features", [("window",), ("softcap",), ("alibi",), ("alibi", "softcap", "window")])
def test_selection_sets_the_feature_flags(arch, fwd, bwd, features):
    for op, name in (("fwd", fwd), ("bwd", bwd)):
        fam, cfg, _ = choose(problem(op, features=features), arch)
        assert fam.name == name
        for f in ("window", "softcap", "alibi"):
            assert getattr(cfg, f) == (f in features), cfg
        short = {"window": "_win", "softcap": "_cap", "alibi": "_alibi"}
        cfg_name, kname = without_sm90_bwd_paths(cfg, cfg.name, cfg.kernel_name())
        assert cfg_name.endswith("".join(short[f] for f in ("window", "softcap", "alibi") if f in features))
        # the flags are template arguments, in order, after the existing ones (sm90_fwd's softcap
        # heuristic also sets kDropout = false, kEmuExp2 after them: tests/test_sm90_softcap_cpu.py)
        if getattr(cfg, "emu_exp2", 0):
            assert kname.endswith(f", false, {cfg.emu_exp2}>")
            kname = kname[:-len(f", false, {cfg.emu_exp2}>")] + ">"
        assert kname.endswith(", ".join("true" if f in features else "false"
                                                    for f in ("window", "softcap", "alibi")) + ">")


def test_plain_problems_keep_plain_configs():
    for op in ("fwd", "bwd"):
        _, cfg, _ = choose(problem(op), (9, 0))
        assert not (cfg.window or cfg.softcap or cfg.alibi)
        if op == "fwd":   # the schedule's trailing flags (dynamic, tma_store) come after the features'
            cfg = cfg.replace(persistent=False, dynamic=False, tma_store=False)
        assert without_sm90_bwd_paths(cfg, cfg.name, cfg.kernel_name())[1].endswith("false, false, false>")


def test_dropout_and_varlen_are_refused_by_name():
    """Dropout with window / softcap / ALiBi: the families with dropout run the mix (sm90_fwd /
    sm90_bwd where it compiles without spills: tests/test_dropmix_cpu.py); the others refuse
    the first feature they lack, by name."""
    for fam in registry.families():
        for f in ("alibi", "softcap", "window"):
            why = fam.supports((9, 0), problem(fam.op, features=tuple(sorted(("dropout", f)))))
            if "dropout" in fam.features:
                assert why == "" or why.startswith(f"{fam.name} has no feature {f!r} with dropout")
            else:  # the first feature it lacks, in sorted order
                lacks = [x for x in sorted(("dropout", f)) if x not in fam.features]
                assert why == f"{fam.name} has no feature {lacks[0]!r}"


def test_explicit_config_gets_the_call_features():
    fam = registry.get("fa2_fwd")
    p = problem(features=("softcap",))
    cfg = fam.heuristic(p.replace(features=()), (8, 0))
    _, got, source = choose(p, (8, 0), config=cfg)
    assert source == "given" and got.softcap and not got.window
    assert fam.encode(got) == fam.encode(cfg)   # flags are not encoded: the call sets them


def test_feature_params():
    from cuflash.features import feature_params

    p = problem(features=("alibi", "softcap", "window"), window=(7, 3), softcap=30.0, alibi_batched=True)
    f = feature_params(p, 0.125)
    assert (f["window_left"], f["window_right"]) == (7, 3)
    assert f["softcap_in"] == pytest.approx(0.125 / 30) and f["softcap_out"] == pytest.approx(240)
    assert f["alibi_batch_stride"] == 8 and f["alibi_slopes"] == 0
    f = feature_params(problem(), 0.125)
    assert (f["window_left"], f["window_right"], f["softcap_in"], f["alibi_batch_stride"]) == (-1, -1, 0, 0)


# ---------------------------------------------------------------------------------------
# nvcc: every feature instantiation the heuristics pick compiles (sm_80 for the fa2 families,
# sm_90a for sm90_fwd), with zero spills where tests/test_compile.py demands it

COMBOS = [("window",), ("softcap",), ("alibi",), ("alibi", "window"), ("alibi", "softcap", "window")]
ARCH = {"fa2_fwd": ("sm_80", (8, 0)), "fa2_bwd": ("sm_80", (8, 0)), "sm90_fwd": ("sm_90a", (9, 0))}
SPILLS_ALLOWED = {"fa2_bwd"}  # as tests/test_compile.py: its heuristic sits at the register budget


def feature_configs(name):
    fam = registry.get(name)
    out = []
    for d in (64, 128):
        for feats in COMBOS:
            for causal in (False, True):
                p = problem(fam.op, d, feats, causal)
                out.append(fam.for_problem(fam.heuristic(p, ARCH[name][1]), p))
    return list(dict.fromkeys(out))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")
@pytest.mark.parametrize("name", sorted(ARCH))
def test_feature_instantiations_compile(name, request):
    import hashlib
    import json

    from cuflash.compile import nvcc_compile, source_hash

    arch = ARCH[name][0]
    configs = feature_configs(name)
    key = hashlib.sha256(json.dumps([source_hash(name), arch] + [c.kernel_name() for c in configs])
                         .encode()).hexdigest()[:24]
    cached = request.config.cache.get(f"cuflash/features/{key}", None)
    if cached is None:
        reports = nvcc_compile(configs, arch)
        cached = [[c.name, r.spill_stores, r.spill_loads] for c, r in zip(configs, reports)]
        request.config.cache.set(f"cuflash/features/{key}", cached)
    assert len(cached) == len(configs)
    if name not in SPILLS_ALLOWED:
        spills = [row for row in cached if row[1] or row[2]]
        assert not spills, spills


# ---------------------------------------------------------------------------------------
# the torch GPU path's plumbing, up to the launch (a fake plan records what it is given)

def test_torch_feature_path_plumbing(monkeypatch):
    import torch

    from cuflash import api, torch_ops

    calls = []

    class FakePlan:
        device, workspace_bytes = 0, 256

        def __init__(self, problem, strides, scale):
            self.problem, self.strides, self.scale = problem, strides, scale

        def run_fields(self, fields, ptrs, ws, stream):
            calls.append((self, fields, ptrs, ws))

    monkeypatch.setattr(api, "make_plan", lambda problem, strides, scale, device, config=None:
                        FakePlan(problem, strides, scale))
    monkeypatch.setattr(torch_ops, "_raw_stream", lambda device: 0)
    api._feature_plans.clear()
    q = torch.randn(2, 100, 4, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 80, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    slopes = torch.rand(2, 4)
    out, lse = torch_ops.forward_features(q, k, v, slopes, 0.125, True, (30, 5), 7.0)
    plan, fields, ptrs, _ = calls[-1]
    p = plan.problem
    assert p.op == "fwd" and p.features == ("alibi", "softcap", "window") and p.causal
    assert p.window == (30, 0) and p.softcap == 7.0 and p.alibi_batched   # causal: right = 0
    assert fields == {"alibi_slopes": slopes.data_ptr()} and len(ptrs) == 5
    assert out.shape == q.shape and lse.shape == (2, 4, 100) and plan.scale == 0.125
    # the same call shape and values reuse the plan
    torch_ops.forward_features(q, k, v, slopes, 0.125, True, (30, 5), 7.0)
    assert calls[-1][0] is plan
    dq, dk, dv = torch_ops.backward_features_impl(torch.randn_like(q), q, k, v, out, lse, slopes,
                                                  0.125, True, False, (30, 5), 7.0)
    plan, fields, ptrs, ws = calls[-1]
    assert plan.problem.op == "bwd" and plan.problem.window == (30, 0) and len(ptrs) == 9
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    # a window reaching past every key and no other feature: the plain kernels (not here)
    calls.clear()
    monkeypatch.setattr(torch_ops, "forward", lambda *a, **kw: ("plain", None))
    assert torch_ops.forward_features(q, k, v, None, 0.125, False, (500, 500), 0.0) == ("plain", None)
    assert not calls


# ---------------------------------------------------------------------------------------
# bench --mode features (the pieces that need no GPU)

def test_bench_features_sdpa_mask_matches_the_reference():
    import numpy as np
    import torch

    from cuflash import reference
    from cuflash.bench import features

    for sq, sk, causal, window in ((7, 11, False, (2, 1)), (11, 7, True, (3, -1)), (5, 5, False, (-1, 0))):
        keep = features.sdpa_mask(sq, sk, causal, window).numpy()
        want = reference.window_mask(sq, sk, window, causal)
        assert np.array_equal(keep, want), (sq, sk, causal, window)
    slopes = features.alibi_slopes(4)
    bias = features.sdpa_mask(6, 9, True, slopes=slopes)
    assert bias.shape == (1, 4, 6, 9)
    assert bias[0, 1, 0, 3].item() == pytest.approx(0.0) and bias[0, 1, 0, 4].item() == -np.inf
    assert bias[0, 2, 5, 0].item() == pytest.approx(-slopes[2].item() * 8)
    assert features.sdpa_mask(4, 4, False) is None


def test_bench_features_mode_is_registered():
    from cuflash import bench

    assert "features" in bench.MODES and "features" not in bench.ALL
    a = bench.parser().parse_args(["--mode", "features", "--feature-cases", "alibi"])
    assert a.feature_seqlens == [8192] and a.feature_hdims == [128] and a.feature_cases == ["alibi"]


def test_bench_features_table():
    from cuflash.bench.features import table

    recs = [dict(impl="cuflash", feature="alibi", op="fwd", dtype="bf16", hdim=128, seqlen=8192, ms=1.0,
                 ratio_vs_plain=1.1, **{"pass": "fwd"}),
            dict(impl="cuflash_plain", feature="alibi", dtype="bf16", hdim=128, seqlen=8192,
                 ms=0.9, ratio_vs_plain=1.0, **{"pass": "fwd"}),
            dict(impl="sdpa_math", feature="alibi", dtype="bf16", hdim=128, seqlen=8192,
                 error="x", **{"pass": "fwd"})]
    text = table(recs)
    assert "| alibi | fwd | bf16 | 128 | 8192 | 1.000 | 0.900 | - | 1.1 | - | - |" in text


def test_tuner_points_carry_the_features():
    """Family.make (the tuner's and the tuned tables' constructor) sets the problem's flags."""
    for name in ("fa2_fwd", "fa2_bwd", "sm90_fwd"):
        fam = registry.get(name)
        p = problem(fam.op, 128, ("alibi", "window"))
        for cfg, _ in list(fam.enumerate(p))[:5]:
            assert cfg.window and cfg.alibi and not cfg.softcap
