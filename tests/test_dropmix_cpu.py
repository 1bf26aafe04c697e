"""Dropout together with window / softcap / ALiBi (issue 12) without a GPU: the reference's
math of the mix against a direct float64 computation with the same keep mask; the torch ops
cuflash::fwd_dropout / bwd_dropout with their appended feature arguments (CPU impls: the
reference with the kernels' mask), opcheck, graphs traced with the old arguments, and
torch.compile(fullgraph=True); the CuPy / NumPy plumbing (problem, slopes, S_dmask with the
features); selection per family; and the nvcc build of the mixed instantiations (fa2_fwd with
zero spills on sm_80 and sm_90a; sm90_fwd / sm90_bwd exactly where supports() allows the mix).
The kernels' numbers are checked on the GPU (tests/test_dropmix_gpu.py)."""
import itertools
import os
import shutil

import numpy as np
import pytest

from cuflash import api, dropout, reference, registry
from cuflash.problem import Problem
from cuflash.select import choose

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")

MIXES = [("dropout", "window"), ("dropout", "softcap"), ("alibi", "dropout"),
         ("alibi", "dropout", "softcap", "window")]


def mix_problem(op="fwd", d=128, causal=True, feats=MIXES[-1], dtype="bf16", det=False):
    return Problem(op, dtype, 2, 1000, 1000, 8, 2, d, causal, det, tuple(feats), dropout_p=0.17,
                   window=(32, 0) if causal else (32, 8), softcap=30.0)


def direct(q, k, v, scale, causal, window, cap, slopes, keep, p):
    """out, lse by hand, float64: q (b, sq, h, d), k, v (b, sk, h_kv, d); slopes (h,) or (b, h)
    or None; keep (b, h, sq, sk) bool. softcap, then ALiBi, then the masks; softmax over the
    visible keys; dropped weights zeroed, kept ones scaled by 1 / (1 - p)."""
    b, sq, h, _ = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    k, v = (np.repeat(x, h // h_kv, axis=2) for x in (k, v))
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    if cap:
        s = cap * np.tanh(s / cap)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    diag = i + sk - sq
    if slopes is not None:
        s = s - np.broadcast_to(slopes, (b, h))[:, :, None, None] * np.abs(diag - j)
    hidden = np.zeros((sq, sk), bool)
    if causal:
        hidden |= j > diag
    if window[0] >= 0:
        hidden |= j < diag - window[0]
    if window[1] >= 0:
        hidden |= j > diag + window[1]
    s = np.where(hidden, -np.inf, s)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    lse = (np.log(e.sum(-1)) + m[..., 0])
    probs = e / e.sum(-1, keepdims=True)
    out = np.einsum("bhij,bjhd->bihd", probs * keep / (1 - p), v)
    return out, lse


def data(b=2, sq=17, sk=23, h=4, h_kv=2, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((b, s, n, d)) for s, n in ((sq, h), (sk, h_kv), (sk, h_kv)))


@pytest.mark.parametrize("causal,window,cap,batched", [
    (True, (5, 0), 3.0, True), (False, (4, 2), 0.0, False), (False, (-1, -1), 2.0, True),
    (True, (-1, 0), 0.0, False)])
def test_reference_mix_is_the_direct_computation(causal, window, cap, batched):
    q, k, v = data()
    keep = dropout.keep_mask(7, 3, 0.3, 2, 4, 17, 23)
    slopes = np.random.default_rng(1).random((2, 4) if batched else (4,))
    got, lse = reference.attention_naive(q, k, v, softmax_scale=0.3, causal=causal, return_lse=True,
                                         window_size=window, softcap=cap, alibi_slopes=slopes,
                                         dropout_p=0.3, dropout_mask=keep)
    want, want_lse = direct(q, k, v, 0.3, causal, window, cap, slopes, keep, 0.3)
    np.testing.assert_allclose(got, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)


def test_host_probs_apply_the_features():
    """dropout_probs_host (NumPy S_dmask) with window / softcap / ALiBi: exp(s - lse) of the
    features' scores, the kernels' dropped entries negated, hidden ones 0."""
    b, sq, sk, h, d = 2, 9, 13, 4, 16
    rng = np.random.default_rng(2)
    q16, k16 = (rng.standard_normal((b, s, h, d)).astype(np.float16) for s in (sq, sk))
    q, k = (x.astype(np.float64) for x in (q16, k16))
    slopes = rng.random((b, h)).astype(np.float32)
    scale, window, cap, p = 0.25, (3, 1), 2.0, 0.2
    keep = dropout.keep_mask(5, 1, p, b, h, sq, sk)
    _, lse = direct(q, k, k, scale, False, window, cap, slopes.astype(np.float64), keep, p)
    got = dropout.dropout_probs_host(q16.view(np.uint16), k16.view(np.uint16), lse, "fp16", scale,
                                     False, p, 5, 1, window=window, softcap=cap, alibi_slopes=slopes)
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    s = cap * np.tanh(s / cap)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    s = s - slopes.astype(np.float64)[:, :, None, None] * np.abs(i + sk - sq - j)
    visible = (j >= i + sk - sq - window[0]) & (j <= i + sk - sq + window[1])
    probs = np.where(visible, np.exp(s - lse[..., None]), 0.0)
    np.testing.assert_allclose(got, np.where(keep, probs, -probs), rtol=1e-5, atol=1e-7)
    # the varlen one: sequence b's corner is the dense call of it alone at batch index b
    cu = np.array([0, sq, 2 * sq]), np.array([0, sk, 2 * sk])
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    lse_v = np.concatenate([lse[0], lse[1]], axis=-1)
    var = dropout.varlen_dropout_probs_host(flat(q16).view(np.uint16), flat(k16).view(np.uint16),
                                            lse_v, *cu, sq, sk, "fp16", scale, False, p, 5, 1,
                                            window=window, softcap=cap, alibi_slopes=slopes)
    np.testing.assert_allclose(var, got, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------
# the torch ops with the feature arguments (CPU impls: the reference with the kernels' mask)

torch = pytest.importorskip("torch")
from cuflash import flash_attn_func, torch_ops  # noqa: E402,F401  (registers the ops)


def tqkv(b=2, sq=17, sk=23, h=4, h_kv=2, d=16, dtype=torch.float64, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, generator=g, dtype=dtype).requires_grad_(grad)
                 for s, n in ((sq, h), (sk, h_kv), (sk, h_kv)))


def as_np(x):
    return x.detach().numpy()


def test_ops_with_features_are_the_reference_with_the_kernels_mask():
    q, k, v = tqkv(grad=False)
    slopes = torch.rand(2, 4, dtype=torch.float32)
    rng = torch.tensor([11, 4], dtype=torch.int64)
    out, lse = torch.ops.cuflash.fwd_dropout(q, k, v, rng, 0.25, True, 0.3, "", slopes, 5, 0, 2.0)
    keep = dropout.keep_mask(11, 4, 0.3, 2, 4, 17, 23)
    kw = dict(softmax_scale=0.25, causal=True, window_size=(5, 0), softcap=2.0,
              alibi_slopes=slopes.double().numpy(), dropout_p=0.3, dropout_mask=keep)
    want, want_lse = reference.attention_naive(as_np(q), as_np(k), as_np(v), return_lse=True, **kw)
    np.testing.assert_allclose(out.numpy(), want, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-6)
    dout = torch.randn_like(out)
    grads = torch.ops.cuflash.bwd_dropout(dout, q, k, v, out, lse, rng, 0.25, True, 0.3, False, "",
                                          slopes, 5, 0, 2.0)
    want = reference.attention_backward_naive(as_np(dout), as_np(q), as_np(k), as_np(v), **kw)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.numpy(), w, atol=1e-12)


def test_old_op_arguments_still_mean_dropout_alone():
    """The feature arguments were appended with defaults: a call (or a traced graph) with the
    old arguments is dropout alone."""
    q, k, v = tqkv(grad=False)
    rng = torch.tensor([3, 0], dtype=torch.int64)
    old = torch.ops.cuflash.fwd_dropout(q, k, v, rng, 0.25, False, 0.2, "")
    new = torch.ops.cuflash.fwd_dropout(q, k, v, rng, 0.25, False, 0.2, "", None, -1, -1, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(old, new))
    schema = str(torch.ops.cuflash.fwd_dropout.default._schema)
    assert schema.endswith("str config, Tensor? alibi_slopes=None, int window_left=-1, "
                           "int window_right=-1, float softcap=0.) -> (Tensor, Tensor)")
    assert "bool deterministic, str config, Tensor? alibi_slopes=None" in \
        str(torch.ops.cuflash.bwd_dropout.default._schema)


def test_opcheck_dropout_ops_with_features():
    q, k, v = tqkv(1, 5, 6, 2, 2, 8, dtype=torch.float32, grad=False)
    rng = torch.tensor([11, 4], dtype=torch.int64)
    slopes = torch.rand(2, dtype=torch.float32)
    args = (q, k, v, rng, 0.3, True, 0.25, "", slopes, 2, 0, 5.0)
    torch.library.opcheck(torch.ops.cuflash.fwd_dropout.default, args)
    out, lse = torch.ops.cuflash.fwd_dropout(*args)
    torch.library.opcheck(torch.ops.cuflash.bwd_dropout.default,
                          (torch.randn_like(out), q, k, v, out, lse, rng, 0.3, True, 0.25, False, "",
                           slopes, 2, 0, 5.0))


@pytest.mark.parametrize("kw", [dict(window_size=(5, -1), causal=True), dict(softcap=3.0),
                                dict(alibi="batched"), dict(window_size=(4, 2), softcap=3.0,
                                                            alibi="heads")],
                         ids=["window_causal", "softcap", "alibi_batched", "all"])
def test_flash_attn_func_with_a_seed_runs_the_mix_through_the_ops(kw):
    """torch CPU tensors with a dropout_seed: the ops, the kernels' keep mask of that seed (S_dmask),
    the features applied; autograd's gradients are the reference's; gradcheck through the ops."""
    kw = dict(kw)
    alibi = kw.pop("alibi", None)
    slopes = None if alibi is None else torch.rand((2, 4) if alibi == "batched" else (4,))
    q, k, v = tqkv()
    out, lse, mask = flash_attn_func(q, k, v, 0.2, alibi_slopes=slopes, return_attn_probs=True,
                                     dropout_seed=(5, 9), **kw)
    keep = dropout.keep_mask(5, 9, 0.2, 2, 4, 17, 23)
    assert mask.dtype == torch.bool and np.array_equal(mask.numpy(), keep)
    causal = kw.get("causal", False)
    window = kw.get("window_size", (-1, -1))
    window = (window[0], 0) if causal and window != (-1, -1) else window
    ref_kw = dict(softmax_scale=0.25, causal=causal, window_size=window, softcap=kw.get("softcap", 0.0),
                  alibi_slopes=None if slopes is None else slopes.double().numpy(), dropout_p=0.2,
                  dropout_mask=keep)
    want = reference.attention_naive(*(as_np(x) for x in (q, k, v)), **ref_kw)
    np.testing.assert_allclose(as_np(out), want, atol=1e-12)
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = reference.attention_backward_naive(as_np(dout), *(as_np(x) for x in (q, k, v)), **ref_kw)
    for x, w in zip((q, k, v), grads):
        np.testing.assert_allclose(x.grad.numpy(), w, atol=1e-10)
    small = tqkv(1, 5, 7, 2, 1, 8)
    slopes_small = None if slopes is None else slopes[..., :2][:1].contiguous() if alibi == "batched" \
        else slopes[:2].contiguous()   # (batch 1, heads 2)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn_func(q, k, v, 0.3, alibi_slopes=slopes_small, dropout_seed=3, **kw),
        small)


def test_torch_compile_fullgraph_with_the_mix():
    """torch.compile(fullgraph=True) traces the dropout ops with the feature arguments: the
    compiled forward and backward match eager (the same seed, so the same mask)."""
    slopes = torch.rand(4)

    def f(q, k, v):
        return flash_attn_func(q, k, v, 0.2, causal=True, window_size=(6, -1), softcap=4.0,
                               alibi_slopes=slopes, dropout_seed=(1, 2))

    q, k, v = tqkv()
    eager = f(q, k, v)
    eager.sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    compiled.sum().backward()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-12)
    for x, g in zip((q, k, v), grads):
        torch.testing.assert_close(x.grad, g, rtol=0, atol=1e-12)


def test_cpu_mix_without_a_seed_is_the_reference_with_torchs_mask():
    """torch CPU without a dropout_seed: the float64 reference with a keep mask from torch's
    CPU generator (S_dmask is that mask), the features applied together with it."""
    q, k, v = tqkv(grad=False)
    torch.manual_seed(4)
    out, lse, mask = flash_attn_func(q, k, v, 0.3, window_size=(3, 3), softcap=2.0,
                                     return_attn_probs=True)
    want = reference.attention_naive(*(as_np(x) for x in (q, k, v)), window_size=(3, 3),
                                     softcap=2.0, dropout_p=0.3, dropout_mask=mask.numpy())
    np.testing.assert_allclose(out.numpy(), want, atol=1e-12)


# ---------------------------------------------------------------------------------------
# CuPy / NumPy plumbing (no GPU: the launch is replaced)

def test_numpy_call_passes_the_features_and_slopes(monkeypatch):
    seen = {}

    def fake(q, k, v, tq, problem, scale, seed, offset, config, slopes=None):
        seen.update(problem=problem, slopes=slopes, seed=(seed, offset))
        b, sq, h, _ = q.shape
        return np.zeros(q.shape, q.dtype), np.zeros((b, h, sq), np.float32)

    monkeypatch.setattr(api, "_dropout_cupy", fake)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, n, 4, 16)).astype(np.float16) for n in (9, 13, 13))
    slopes = rng.random((2, 4)).astype(np.float32)
    out, lse, probs = flash_attn_func(q, k, v, 0.2, causal=True, window_size=(3, -1), softcap=2.0,
                                      alibi_slopes=slopes, deterministic=True,
                                      return_attn_probs=True, dropout_seed=(5, 6))
    p = seen["problem"]
    assert p.features == ("alibi", "dropout", "softcap", "window") and p.causal and p.deterministic
    assert p.window == (3, 0) and p.softcap == 2.0 and p.alibi_batched and p.dropout_p == 0.2
    assert seen["slopes"] is slopes and seen["seed"] == (5, 6)
    want = dropout.dropout_probs_host(q.view(np.uint16), k.view(np.uint16), lse, "fp16", 0.25, True,
                                      0.2, 5, 6, window=(3, 0), softcap=2.0, alibi_slopes=slopes)
    np.testing.assert_array_equal(probs, want)
    assert (probs[..., 0, 5:] == 0).all()     # row 0 sees keys 1..4 (bottom-right, left 3)


def test_backward_passes_the_features_and_slopes(monkeypatch):
    seen = {}

    def fake(dout, q, k, v, out, lse, tq, tdo, to, problem, scale, dropout_seed, seed, offset,
             config, slopes=None):
        seen.update(problem=problem, slopes=slopes, seed=(seed, offset))
        return "grads"

    monkeypatch.setattr(api, "_dropout_backward", fake)
    q, k, v = tqkv(grad=False)
    out = torch.zeros_like(q)
    lse = torch.zeros(2, 4, 17, dtype=torch.float32)
    slopes = torch.rand(4)
    assert api.flash_attn_backward(out, q, k, v, out, lse, causal=True, window_size=(3, 3),
                                   alibi_slopes=slopes, dropout_p=0.1, dropout_seed=9) == "grads"
    p = seen["problem"]
    assert p.op == "bwd" and p.features == ("alibi", "dropout", "window") and p.window == (3, 0)
    assert seen["slopes"] is slopes and seen["seed"] == (9, 0) and p.dropout_p == 0.1


# ---------------------------------------------------------------------------------------
# selection per family

def test_fa2_families_run_every_mix():
    for op, feats, d, causal, det, cc in itertools.product(("fwd", "bwd"), MIXES, (64, 128, 256),
                                                            (False, True), (False, True),
                                                            ((8, 0), (9, 0))):
        fam = registry.get(f"fa2_{op}")
        p = mix_problem(op, d, causal, feats, det=det)
        assert fam.supports(cc, p) == ""
        cfg = fam.for_problem(fam.heuristic(p, cc), p)
        assert cfg.dropout and cfg.window == ("window" in feats) and cfg.softcap == ("softcap" in feats)
        assert cfg.alibi == ("alibi" in feats)
    # varlen with the mix too
    p = mix_problem().replace(features=("alibi", "dropout", "softcap", "varlen", "window"))
    assert registry.get("fa2_fwd").supports((8, 0), p) == ""


def test_sm90_families_run_the_mix_where_it_compiles_else_fall_back():
    fwd, bwd = registry.get("sm90_fwd"), registry.get("sm90_bwd")
    for feats, causal in itertools.product(MIXES, (False, True)):
        cap = "softcap" in feats
        assert fwd.supports((9, 0), mix_problem("fwd", 64, causal, feats)) == ""
        assert (fwd.supports((9, 0), mix_problem("fwd", 128, causal, feats)) == "") == (not cap)
        for d in (96, 192, 256):  # unchecked head dims: refused
            assert "with dropout" in fwd.supports((9, 0), mix_problem("fwd", d, causal, feats))
        spills = "window" in feats and ("softcap" in feats or "alibi" in feats)   # dropout_dq_path
        assert (bwd.supports((9, 0), mix_problem("bwd", 128, causal, feats)) == "") == (not spills)
        assert "deterministic" in bwd.supports((9, 0), mix_problem("bwd", 128, causal, feats, det=True))
        # selection: the sm90 family where it runs the mix, else fa2 (never an error)
        fam, cfg, _ = choose(mix_problem("fwd", 128, causal, feats), (9, 0), dirs=[])
        assert fam.name == ("fa2_fwd" if cap else "sm90_fwd") and cfg.dropout
        fam, cfg, _ = choose(mix_problem("bwd", 128, causal, feats), (9, 0), dirs=[])
        assert fam.name == ("fa2_bwd" if spills else "sm90_bwd") and cfg.dropout
        fam, _, _ = choose(mix_problem("bwd", 128, causal, feats, det=True), (9, 0), dirs=[])
        assert fam.name == "fa2_bwd"


# ---------------------------------------------------------------------------------------
# nvcc builds of the mixed instantiations

def _reports(cfgs, arch):
    from concurrent.futures import ThreadPoolExecutor

    from cuflash.compile import nvcc_compile

    chunks = [cfgs[i:i + 4] for i in range(0, len(cfgs), 4)]
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        return [r for rs in pool.map(lambda c: nvcc_compile(c, arch, NVCC), chunks) for r in rs]


def _bad(cfgs, reports):
    return [f"{c.name}: {r}" for c, r in zip(cfgs, reports)
            if r.spill_stores or r.spill_loads or r.stack_bytes
            or any("C751" in w or "serialized" in w for w in r.warnings)]


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_fa2_fwd_mixed_instantiations_compile_without_spills(arch):
    """fa2_fwd's heuristic with dropout + window / softcap / ALiBi / all three, d 64 and 128,
    both masks, the dtypes alternating: no spills (fa2_bwd's may spill a few bytes, as
    tests/test_compile.py allows for its heuristic; nvcc 13.0 on sm_80 spills 4..104 bytes with
    softcap: the fallback's cost, not a wrong answer)."""
    cc = (9, 0) if arch == "sm_90a" else (8, 0)
    fam = registry.get("fa2_fwd")
    cfgs = []
    for i, (d, causal, feats) in enumerate(itertools.product((64, 128), (False, True), MIXES)):
        p = mix_problem("fwd", d, causal, feats, ("bf16", "fp16")[i % 2])
        cfgs.append(fam.for_problem(fam.heuristic(p, cc), p))
    bad = _bad(cfgs, _reports(cfgs, arch))
    assert not bad, "\n".join(bad)


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_fa2_bwd_mixed_instantiations_compile(arch):
    """fa2_bwd's heuristic with dropout + window + softcap + ALiBi, d 64 and 128: it compiles
    (spills allowed, as for its plain heuristic in tests/test_compile.py: 4..200 bytes with
    softcap under nvcc 13.0)."""
    cc = (9, 0) if arch == "sm_90a" else (8, 0)
    fam = registry.get("fa2_bwd")
    cfgs = [fam.for_problem(fam.heuristic(p, cc), p)
            for p in (mix_problem("bwd", 64, True), mix_problem("bwd", 128, False, dtype="fp16"))]
    reports = _reports(cfgs, arch)
    assert len(reports) == 2 and all(r.registers > 0 for r in reports)


@needs_nvcc
@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_sm90_allowed_mixes_compile_without_spills(op):
    """Every mix that sm90_fwd / sm90_bwd's supports() allows at d 64 and 128 (both masks, the
    dtypes alternating; both were checked when the rule was set): no spills, no stack, no wgmma
    serialization on sm_90a (~1 min on 2 cores)."""
    fam = registry.get(f"sm90_{op}")
    cfgs = []
    for i, (d, causal, feats) in enumerate(itertools.product((64, 128), (False, True), MIXES)):
        p = mix_problem(op, d, causal, feats, ("bf16", "fp16")[(i // 4 + i) % 2])
        if not fam.supports((9, 0), p):
            cfgs.append(fam.for_problem(fam.heuristic(p, (9, 0)), p))
    assert len(cfgs) >= 12
    bad = _bad(cfgs, _reports(cfgs, "sm_90a"))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("causal,window,cap,alibi", [(True, (3, 0), 2.0, "bh"), (False, (4, 1), 0.0, "h"),
                                                     (False, (-1, -1), 1.5, None)])
def test_torch_probs_match_the_host_probs(causal, window, cap, alibi):
    """torch_ops.dropout_probs (the torch GPU S_dmask, run here on CPU tensors) applies the
    features as dropout_probs_host (the CuPy / NumPy one) does."""
    b, sq, sk, h, d = 2, 9, 13, 4, 16
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(b, s, n, d, generator=g).half() for s, n in ((sq, h), (sk, 2)))
    slopes = None if alibi is None else torch.rand((b, h) if alibi == "bh" else (h,), generator=g)
    lse = torch.randn(b, h, sq, generator=g).abs() + 3.0
    rng = torch.tensor([21, 8], dtype=torch.int64)
    got = torch_ops.dropout_probs(q, k, k, lse, 0.25, causal, 0.2, rng, window, cap, slopes)
    want = dropout.dropout_probs_host(q.view(torch.int16).numpy().view(np.uint16),
                                      k.view(torch.int16).numpy().view(np.uint16), lse.numpy(),
                                      "fp16", 0.25, causal, 0.2, 21, 8, window=window, softcap=cap,
                                      alibi_slopes=None if slopes is None else slopes.numpy())
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)
    assert (got != 0).sum() > 0
