"""Variable-length batches with window / softcap / ALiBi / dropout, the parts that need no GPU:
the float64 reference composed per sequence, dropout's keep mask keyed by the sequence's batch
index, validation (errors name the argument, before any launch), the host plumbing up to the
launch (a fake plan records it), and nvcc builds of the new instantiations for sm_80 and
sm_90a (the forward spills nothing; the backward at most EXTRA_SPILL bytes more than its
fixed-length twin, as tests/test_varlen_compile.py allows).
"""
import shutil

import numpy as np
import pytest

import cuflash
from cuflash import api, dropout, reference, registry, varlen
from cuflash.problem import Problem

# ---------------------------------------------------------------------------------------
# reference and dropout mask


def test_reference_varlen_features_are_the_dense_ones_per_sequence():
    rng = np.random.default_rng(0)
    lens_q, lens_k = [3, 0, 7, 1], [5, 4, 2, 1]
    h, hkv, d = 4, 2, 8
    cq, ck = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    q = rng.standard_normal((cq[-1], h, d))
    k, v = (rng.standard_normal((ck[-1], hkv, d)) for _ in range(2))
    slopes = rng.random((4, h))
    kw = dict(window_size=(2, 1), softcap=3.0, alibi_slopes=slopes)
    out, lse = reference.attention_varlen_naive(q, k, v, cq, ck, 0.3, True, True, **kw)
    for b in range(4):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if lens_q[b] == 0:
            continue
        o, l = reference.attention_naive(q[None, sq], k[None, sk], v[None, sk], 0.3, True, True,
                                         window_size=(2, 1), softcap=3.0, alibi_slopes=slopes[b:b + 1])
        np.testing.assert_allclose(out[sq], o[0])
        np.testing.assert_allclose(lse[:, sq], l[0])


def test_keep_mask_of_a_sequence_is_the_dense_mask_at_its_batch_index():
    full = dropout.keep_mask(11, 3, 0.3, 4, 2, 19, 37)
    for b in range(4):
        alone = dropout.keep_mask(11, 3, 0.3, 1, 2, 19, 37, first_batch=b)
        assert np.array_equal(alone[0], full[b])
        short = dropout.keep_mask(11, 3, 0.3, 1, 2, 5, 20, first_batch=b)  # rows, columns from 0
        assert np.array_equal(short[0], full[b, :, :5, :20])


def test_varlen_dropout_probs_are_the_dense_ones_in_the_corners():
    rng = np.random.default_rng(1)
    lens = [6, 6, 6]
    h, d = 2, 16
    q = rng.standard_normal((18, h, d)).astype(np.float16)
    k = rng.standard_normal((18, h, d)).astype(np.float16)
    s = np.einsum("bihd,bjhd->bhij", q.reshape(3, 6, h, d).astype(np.float64),
                  k.reshape(3, 6, h, d).astype(np.float64)) * 0.25
    lse = np.log(np.exp(s).sum(-1)).astype(np.float32)               # (3, h, 6)
    dense = dropout.dropout_probs_host(q.reshape(3, 6, h, d).view(np.uint16),
                                       k.reshape(3, 6, h, d).view(np.uint16), lse, "fp16", 0.25,
                                       False, 0.2, 5, 7)
    cu = np.array([0, 6, 12, 18])
    got = dropout.varlen_dropout_probs_host(q.view(np.uint16), k.view(np.uint16),
                                            lse.transpose(1, 0, 2).reshape(h, 18), cu, cu, 8, 9,
                                            "fp16", 0.25, False, 0.2, 5, 7)
    assert got.shape == (3, h, 8, 9)
    np.testing.assert_array_equal(got[:, :, :6, :6], dense)
    assert not got[:, :, 6:].any() and not got[:, :, :, 6:].any()


# ---------------------------------------------------------------------------------------
# validation, before any launch


def np_packed(total_q=5, total_k=5, h=4, d=16):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((total_q, h, d)).astype(np.float16),
            rng.standard_normal((total_k, h, d)).astype(np.float16),
            rng.standard_normal((total_k, h, d)).astype(np.float16))


def test_numpy_varlen_features_validate_then_reach_the_gpu(monkeypatch):
    from cuflash import _gpu
    from cuflash._gpu import NoGPUError

    def require(what):
        raise NoGPUError(f"{what}: no GPU")
    monkeypatch.setattr(_gpu, "require", require)
    q, k, v = np_packed()
    cu = np.array([0, 2, 5], np.int32)
    for kw in (dict(window_size=(1, 0)), dict(softcap=5.0, causal=True),
               dict(alibi_slopes=np.ones((2, 4), np.float32)), dict(dropout_p=0.1, dropout_seed=3)):
        with pytest.raises(NoGPUError, match="flash_attn_varlen_func"):
            cuflash.flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, **kw)
    with pytest.raises(ValueError, match="^dropout_seed: numpy inputs with dropout_p > 0"):
        cuflash.flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, 0.1)
    with pytest.raises(ValueError, match=r"^alibi_slopes: expected shape \(nheads,\)"):
        cuflash.flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, alibi_slopes=np.ones((3, 4), np.float32))
    with pytest.raises(TypeError, match="^dropout_seed must be"):
        cuflash.flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, 0.1, dropout_seed="x")
    qkv = np.stack([q, k, v], 1)
    with pytest.raises(NoGPUError, match="flash_attn_varlen_func"):  # the packed variants pass the seed
        cuflash.flash_attn_varlen_qkvpacked_func(qkv, cu, 3, 0.1, dropout_seed=(1, 2))
    with pytest.raises(NoGPUError, match="flash_attn_varlen_func"):
        cuflash.flash_attn_varlen_kvpacked_func(q, qkv[:, 1:], cu, cu, 3, 3, 0.1, dropout_seed=4)
    with pytest.raises(NoGPUError, match="flash_attn_varlen_func"):  # dropout with softcap runs too
        cuflash.flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, 0.1, softcap=2.0, dropout_seed=1)


def test_varlen_backward_features_validate(monkeypatch):
    q, k, v = np_packed()
    cu = np.array([0, 2, 5], np.int32)
    lse = np.zeros((4, 5), np.float32)
    with pytest.raises(TypeError, match="^flash_attn_varlen_backward takes CuPy"):
        api.flash_attn_varlen_backward(q, q, k, v, q, lse, cu, cu, 3, 3, window_size=(2, 2))
    with pytest.raises(TypeError, match="^window_size must be a pair"):
        api.flash_attn_varlen_backward(q, q, k, v, q, lse, cu, cu, 3, 3, window_size=3)
    with pytest.raises(ValueError, match="^softcap must be"):
        api.flash_attn_varlen_backward(q, q, k, v, q, lse, cu, cu, 3, 3, softcap=-1.0)


# ---------------------------------------------------------------------------------------
# host plumbing up to the launch (a fake plan records what it is given)


class FakePlan:
    device, workspace_bytes = 0, 256

    def __init__(self, problem, strides, scale, calls):
        self.problem, self.strides, self.scale, self.calls = problem, strides, scale, calls

    def run_with(self, ptrs, ws, stream, extra):
        self.calls.append((self, ptrs, ws, dict(extra)))


def test_torch_varlen_feature_plumbing(monkeypatch):
    torch = pytest.importorskip("torch")
    from cuflash import varlen_torch

    calls = []
    monkeypatch.setattr(api, "make_plan", lambda problem, strides, scale, device, config=None:
                        FakePlan(problem, strides, scale, calls))
    monkeypatch.setattr(varlen_torch, "_raw_stream", lambda device: 0)
    varlen._feature_plans.clear()
    cu_q = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 6], dtype=torch.int32)
    q = torch.randn(10, 4, 70, dtype=torch.bfloat16)      # head dim 70: zero-padded to 72
    k, v = (torch.randn(6, 2, 70, dtype=torch.bfloat16) for _ in range(2))
    slopes = torch.rand(3, 4)
    rng = torch.tensor([5, 6], dtype=torch.int64)
    out, lse = varlen_torch.forward_features(q, k, v, cu_q, cu_k, 7, 5, 0.125, True, slopes, (30, -1),
                                             7.0, 0.0, None)
    plan, ptrs, ws, extra = calls[-1]
    p = plan.problem
    assert p.op == "fwd" and p.features == ("alibi", "softcap", "varlen", "window") and p.causal
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads_kv, p.head_dim) == (3, 7, 5, 4, 2, 72)
    assert p.window == (30, -1) and p.softcap == 7.0 and p.alibi_batched and plan.scale == 0.125
    assert plan.strides["totals"] == (10, 6) and plan.strides["q"][0] == 0   # batch stride 0
    assert extra == {"cu_seqlens_q": cu_q.data_ptr(), "cu_seqlens_k": cu_k.data_ptr(),
                     "alibi_slopes": slopes.data_ptr()}
    assert out.shape == q.shape and lse.shape == (4, 10) and len(ptrs) == 5
    varlen_torch.forward_features(q, k, v, cu_q, cu_k, 7, 5, 0.125, True, slopes, (30, -1), 7.0, 0.0, None)
    assert calls[-1][0] is plan  # one plan per call shape and feature values
    # dropout: the RNG state's address per call, dropout_p in the problem
    varlen_torch.forward_features(q, k, v, cu_q, cu_k, 7, 5, 0.125, False, None, (-1, -1), 0.0, 0.25, rng)
    plan, _, _, extra = calls[-1]
    assert plan.problem.features == ("dropout", "varlen") and plan.problem.dropout_p == 0.25
    assert extra == {"cu_seqlens_q": cu_q.data_ptr(), "cu_seqlens_k": cu_k.data_ptr(),
                     "rng_state": rng.data_ptr()}
    # backward: op bwd, deterministic, the same features
    dq, dk, dv = varlen_torch.backward_features(torch.randn_like(q), q, k, v, out, lse, cu_q, cu_k, 7,
                                                5, 0.125, True, True, slopes, (30, -1), 7.0, 0.0, None)
    plan, ptrs, ws, extra = calls[-1]
    assert plan.problem.op == "bwd" and plan.problem.deterministic and len(ptrs) == 9
    assert plan.problem.features == ("alibi", "softcap", "varlen", "window")
    assert extra["alibi_slopes"] == slopes.data_ptr() and ws != 0
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_varlen_feature_problems_select_fa2_with_their_flags():
    from cuflash.select import choose

    for op in ("fwd", "bwd"):
        p = varlen.features_problem(op, "bf16", 3, 1000, 1200, 8, 2, 128, True, (256, -1), 30.0, True)
        fam, cfg, _ = choose(p, (9, 0))
        # sm90_fwd / sm90_bwd on sm_90 (tests/test_sm90_varlen_cpu.py; d128), fa2 on sm_80
        assert fam.name == ("sm90_fwd" if op == "fwd" else "sm90_bwd")
        assert cfg.varlen and cfg.window and cfg.softcap and cfg.alibi
        fam, cfg, _ = choose(p, (8, 0))
        assert fam.name == "fa2_" + op and cfg.varlen and cfg.window and cfg.softcap and cfg.alibi
        p = varlen.features_problem(op, "fp16", 3, 1000, 1200, 8, 8, 64, False, dropout_p=0.1)
        fam, cfg, _ = choose(p, (8, 0))
        assert cfg.varlen and cfg.dropout and not cfg.window


# ---------------------------------------------------------------------------------------
# nvcc: the varlen feature instantiations the heuristics pick

ARCHS = {"sm_80": (8, 0), "sm_90a": (9, 0)}
EXTRA_SPILL = 32  # as tests/test_varlen_compile.py
COMBOS = [(("window",), True), (("window",), False), (("softcap",), True),
          (("alibi", "softcap", "window"), False), (("dropout",), True), (("dropout",), False)]


def varlen_feature_pairs(name, cc):
    """(fixed-length twin, varlen config) of the heuristic, head dims 64, 128 and 80."""
    fam = registry.get(name)
    out = []
    for d in (64, 80, 128):
        for feats, causal in COMBOS:
            p = Problem(fam.op, "bf16" if causal else "fp16", 3, 1000, 1200, 4, 2, d, causal, False,
                        tuple(sorted(feats + ("varlen",))), window=(64, 8) if "window" in feats else (-1, -1))
            cfg = fam.for_problem(fam.heuristic(p, cc), p)
            out.append((cfg.replace(varlen=False), cfg))
    return list(dict.fromkeys(out))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")
@pytest.mark.parametrize("name", ["fa2_fwd", "fa2_bwd"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_varlen_feature_instantiations_compile(name, arch, request):
    import hashlib
    import json

    from cuflash.compile import nvcc_compile, source_hash

    pairs = varlen_feature_pairs(name, ARCHS[arch])
    configs = [c for pair in pairs for c in pair]
    key = hashlib.sha256(json.dumps([source_hash(name), arch] + [c.kernel_name() for c in configs])
                         .encode()).hexdigest()[:24]
    cached = request.config.cache.get(f"cuflash/varlen_features/{key}", None)
    if cached is None:
        reports = nvcc_compile(configs, arch)
        cached = [[c.name, r.registers, r.spill_stores, r.spill_loads] for c, r in zip(configs, reports)]
        request.config.cache.set(f"cuflash/varlen_features/{key}", cached)
    assert len(cached) == len(configs)
    for twin, var in zip(cached[::2], cached[1::2]):
        print(f"{arch} {var[0]}: {var[1]} regs, {var[2]} B spill stores (fixed-length {twin[2]} B)")
        if name == "fa2_fwd":
            assert var[2] == 0 and var[3] == 0, var
        assert var[2] <= twin[2] + EXTRA_SPILL, (twin, var)
