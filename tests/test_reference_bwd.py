"""CPU tests for the backward pass of cuflash.reference (the gradient oracle).

attention_backward_naive is checked against central finite differences of
attention_naive (and against torch autograd in float64 when torch is
installed); attention_backward_tiled is checked against
attention_backward_naive; attention_grad_lowp is checked for sane errors.
"""

import math

import numpy as np
import pytest

from cuflash.reference import (
    attention_backward_naive,
    attention_backward_tiled,
    attention_grad_lowp,
    attention_naive,
    attention_tiled,
    causal_mask,
)
from conftest import random_attention_inputs, strict_fp


def make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim,
                dtype=np.float64):
    """Fresh random (dout, q, k, v) and the seed that made them."""
    (q, k, v, dout), seed = random_attention_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_kv,
                                                    headdim, dtype)
    return (dout, q, k, v), seed


def assert_grads_close(grads, refs, seed, rtol=1e-10, atol=1e-10):
    """Compare (dq, dk, dv) to references; atol scales with the gradient."""
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert g.shape == r.shape, f"{name} shape {g.shape} != {r.shape}"
        assert g.dtype == np.float64, f"{name} dtype {g.dtype}"
        assert np.isfinite(g).all(), f"{name} not finite (seed {seed})"
        tol = atol * max(1.0, float(np.abs(r).max(initial=0.0)))
        np.testing.assert_allclose(g, r, rtol=rtol, atol=tol,
                                   err_msg=f"{name} (seed {seed})")


def check_tiled_vs_naive(batch, seqlen_q, seqlen_k, nheads, nheads_kv,
                         headdim, causal, block_q, block_k,
                         softmax_scale=None):
    (dout, q, k, v), seed = make_inputs(batch, seqlen_q, seqlen_k, nheads,
                                        nheads_kv, headdim)
    with strict_fp():
        ref = attention_backward_naive(dout, q, k, v,
                                       softmax_scale=softmax_scale,
                                       causal=causal)
        out, lse = attention_tiled(q, k, v, softmax_scale=softmax_scale,
                                   causal=causal)
        grads = attention_backward_tiled(dout, q, k, v, out, lse,
                                         softmax_scale=softmax_scale,
                                         causal=causal, block_q=block_q,
                                         block_k=block_k)
    assert grads[0].shape == q.shape and grads[1].shape == k.shape
    assert grads[2].shape == v.shape
    assert_grads_close(grads, ref, seed)


# ---------------------------------------------------------------------------
# tiled vs naive
# ---------------------------------------------------------------------------

SEQLENS = [(1, 1), (1, 17), (17, 1), (17, 17), (113, 203), (203, 113),
           (203, 203)]
# (headdim, nheads, nheads_kv, block_q, block_k, softmax_scale)
CONFIGS = [
    pytest.param(32, 4, 4, 64, 64, None, id="d32-mha"),
    pytest.param(40, 4, 2, 16, 48, None, id="d40-gqa-16x48"),
    pytest.param(64, 4, 1, 37, 29, 0.37, id="d64-mqa-37x29-scale0.37"),
    pytest.param(128, 2, 2, 64, 32, None, id="d128-mha-64x32"),
    pytest.param(256, 3, 1, 32, 64, 0.05, id="d256-mqa-32x64-scale0.05"),
]


@pytest.mark.parametrize(
    "headdim,nheads,nheads_kv,block_q,block_k,softmax_scale", CONFIGS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_tiled_matches_naive(seqlen_q, seqlen_k, causal, headdim, nheads,
                             nheads_kv, block_q, block_k, softmax_scale):
    check_tiled_vs_naive(2, seqlen_q, seqlen_k, nheads, nheads_kv, headdim,
                         causal, block_q, block_k, softmax_scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k",
                         [(1023, 1023), (1023, 17), (17, 1023)])
def test_tiled_matches_naive_long(seqlen_q, seqlen_k, causal):
    check_tiled_vs_naive(1, seqlen_q, seqlen_k, 2, 1, 32, causal, 128, 48)


@pytest.mark.parametrize("block_q,block_k", [(1, 1), (7, 5), (64, 16),
                                             (300, 300)])
def test_tiled_odd_blocks(block_q, block_k):
    # Blocks that do not divide the sequence lengths, and larger than them.
    for causal in (False, True):
        check_tiled_vs_naive(1, 37, 53, 4, 2, 32, causal, block_q, block_k)
        check_tiled_vs_naive(1, 53, 37, 4, 2, 32, causal, block_q, block_k)


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_accepts_naive_lse_and_default_blocks(causal):
    # out/lse from attention_naive(return_lse=True) work as well as the
    # tiled forward's; the default block sizes and scale are the documented
    # ones.
    (dout, q, k, v), seed = make_inputs(2, 150, 70, 4, 2, 64)
    ref = attention_backward_naive(dout, q, k, v, causal=causal)
    out, lse = attention_naive(q, k, v, causal=causal, return_lse=True)
    grads = attention_backward_tiled(dout, q, k, v, out, lse, causal=causal)
    assert_grads_close(grads, ref, seed)
    explicit = attention_backward_tiled(dout, q, k, v, out, lse,
                                        softmax_scale=1 / 8, causal=causal,
                                        block_q=64, block_k=64)
    for g, e in zip(grads, explicit):
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_with_gpu_like_forward_outputs(causal):
    # A GPU kernel returns out in the input dtype and a float32 LSE; the
    # backward then matches the exact gradient to about that precision.
    (dout, q, k, v), seed = make_inputs(1, 97, 61, 4, 1, 64, np.float16)
    ref = attention_backward_naive(dout, q, k, v, causal=causal)
    out, lse = attention_naive(q, k, v, causal=causal, return_lse=True)
    out16, lse32 = out.astype(np.float16), lse.astype(np.float32)
    with strict_fp():
        grads = attention_backward_tiled(dout, q, k, v, out16, lse32,
                                         causal=causal, block_q=32,
                                         block_k=16)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert g.dtype == np.float64 and np.isfinite(g).all()
        err = np.abs(g - r).max() / np.abs(r).max()
        assert err < 5e-3, f"{name} relative error {err:.3g} (seed {seed})"
    if causal:  # seqlen_q > seqlen_k: the first 36 rows see no key
        assert np.isposinf(lse32[:, :, :36]).all()
        assert (grads[0][:, :36] == 0).all()


# ---------------------------------------------------------------------------
# naive backward vs finite differences (and torch autograd)
# ---------------------------------------------------------------------------

def loss(dout, q, k, v, softmax_scale, causal):
    return float(np.sum(dout * attention_naive(q, k, v, softmax_scale,
                                               causal)))


FD_SHAPES = [(1, 1), (1, 5), (5, 1), (3, 5), (5, 3), (4, 4)]


@pytest.mark.parametrize("softmax_scale", [None, 0.7])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", FD_SHAPES)
def test_naive_matches_finite_differences(seqlen_q, seqlen_k, causal,
                                          softmax_scale):
    # The directional derivative of L = sum(dout * O) along a random
    # direction u of one input equals <grad, u>; central differences give
    # it to O(eps^2).
    (dout, q, k, v), seed = make_inputs(1, seqlen_q, seqlen_k, 2, 1, 8)
    rng = np.random.default_rng(seed + 1)
    grads = attention_backward_naive(dout, q, k, v, softmax_scale, causal)
    inputs = {"q": q, "k": k, "v": v}
    eps = 1e-5
    for (name, x), g in zip(inputs.items(), grads):
        for _ in range(3):
            u = rng.standard_normal(x.shape)
            plus = dict(inputs, **{name: x + eps * u})
            minus = dict(inputs, **{name: x - eps * u})
            fd = (loss(dout, **plus, softmax_scale=softmax_scale,
                       causal=causal)
                  - loss(dout, **minus, softmax_scale=softmax_scale,
                         causal=causal)) / (2 * eps)
            exact = float(np.sum(g * u))
            assert abs(fd - exact) <= 1e-6 * (1 + abs(exact)), (
                f"d{name}: finite differences {fd!r} vs {exact!r} "
                f"(seed {seed})")


@pytest.mark.parametrize("causal", [False, True])
def test_naive_matches_elementwise_finite_differences(causal):
    # Every entry of dq, dk, dv, with fully masked rows when causal.
    (dout, q, k, v), seed = make_inputs(1, 5, 3, 2, 1, 8)
    grads = attention_backward_naive(dout, q, k, v, causal=causal)
    inputs = {"q": q, "k": k, "v": v}
    eps = 1e-5
    for (name, x), g in zip(inputs.items(), grads):
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            step = np.zeros_like(x)
            step[idx] = eps
            fd[idx] = (loss(dout, **dict(inputs, **{name: x + step}),
                            softmax_scale=None, causal=causal)
                       - loss(dout, **dict(inputs, **{name: x - step}),
                              softmax_scale=None, causal=causal)) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8,
                                   err_msg=f"d{name} (seed {seed})")
    if causal:
        assert (grads[0][:, :2] == 0).all()


def torch_attention_grads(dout, q, k, v, softmax_scale, causal, dtype):
    """Plain attention in torch (repeated kv heads), autograd gradients."""
    import torch

    group = q.shape[2] // k.shape[2]
    tq, tk, tv = (torch.tensor(x, dtype=dtype, requires_grad=True)
                  for x in (q, k, v))
    kk = tk.repeat_interleave(group, dim=2)
    vv = tv.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", tq, kk) * softmax_scale
    if causal:
        keep = torch.from_numpy(causal_mask(q.shape[1], k.shape[1]))
        s = s.masked_fill(~keep, -math.inf)
    out = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), vv)
    out.backward(torch.tensor(dout, dtype=dtype))
    return [x.grad.double().numpy() for x in (tq, tk, tv)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (19, 19), (13, 40),
                                               (40, 40)])
def test_naive_matches_torch_autograd_float64(seqlen_q, seqlen_k, causal):
    # torch's softmax gives NaN on fully masked rows, so seqlen_q <= seqlen_k.
    torch = pytest.importorskip("torch")
    (dout, q, k, v), seed = make_inputs(2, seqlen_q, seqlen_k, 6, 2, 32)
    ref = torch_attention_grads(dout, q, k, v, 0.3, causal, torch.float64)
    grads = attention_backward_naive(dout, q, k, v, 0.3, causal)
    assert_grads_close(grads, ref, seed)


# ---------------------------------------------------------------------------
# fully masked rows, empty inputs
# ---------------------------------------------------------------------------

@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("fn", ["naive", "tiled"])
def test_fully_masked_rows_contribute_nothing(fn):
    # seqlen_q > seqlen_k with causal: rows i < seqlen_q - seqlen_k see no
    # key. Their dq is 0, and dk, dv equal the gradients of the visible rows
    # alone.
    seqlen_q, seqlen_k = 20, 6
    n_empty = seqlen_q - seqlen_k
    (dout, q, k, v), seed = make_inputs(2, seqlen_q, seqlen_k, 4, 2, 32)
    with strict_fp():
        if fn == "naive":
            dq, dk, dv = attention_backward_naive(dout, q, k, v, causal=True)
        else:
            out, lse = attention_tiled(q, k, v, causal=True)
            dq, dk, dv = attention_backward_tiled(dout, q, k, v, out, lse,
                                                  causal=True, block_q=8,
                                                  block_k=4)
        dq_vis, dk_vis, dv_vis = attention_backward_naive(
            dout[:, n_empty:], q[:, n_empty:], k, v, causal=True)
    for g in (dq, dk, dv):
        assert np.isfinite(g).all()
    assert (dq[:, :n_empty] == 0).all()
    # (Row n_empty sees one key only: its softmax is constant, dq ~ 0.)
    assert (np.abs(dq[:, n_empty + 1:]).sum(-1) > 1e-3).all()
    assert_grads_close((dq[:, n_empty:], dk, dv), (dq_vis, dk_vis, dv_vis),
                       seed)


@pytest.mark.filterwarnings("error")
def test_entire_q_blocks_masked_in_tiled():
    # Whole Q blocks without keys, and block pairs the causal loop skips.
    (dout, q, k, v), seed = make_inputs(1, 200, 30, 2, 1, 64)
    with strict_fp():
        out, lse = attention_tiled(q, k, v, causal=True)
        grads = attention_backward_tiled(dout, q, k, v, out, lse,
                                         causal=True)
        ref = attention_backward_naive(dout, q, k, v, causal=True)
    assert (grads[0][:, :170] == 0).all()
    assert_grads_close(grads, ref, seed)


@pytest.mark.filterwarnings("error")
def test_lse_inf_rows_ignore_out_and_dout():
    # A row with LSE = +inf gives P = 0 whatever out and dout hold there.
    (dout, q, k, v), seed = make_inputs(1, 12, 4, 2, 2, 16)
    out, lse = attention_tiled(q, k, v, causal=True)
    out[:, :8] = 1e3
    with strict_fp():
        grads = attention_backward_tiled(dout, q, k, v, out, lse,
                                         causal=True, block_q=5, block_k=3)
    ref = attention_backward_naive(dout, q, k, v, causal=True)
    assert_grads_close(grads, ref, seed)


@pytest.mark.filterwarnings("error")
def test_empty_kv_gives_zero_gradients():
    (dout, q, k, v), _ = make_inputs(1, 5, 0, 2, 1, 8)
    with strict_fp():
        out, lse = attention_tiled(q, k, v)
        for grads in (attention_backward_naive(dout, q, k, v),
                      attention_backward_tiled(dout, q, k, v, out, lse)):
            assert grads[0].shape == q.shape and (grads[0] == 0).all()
            assert grads[1].shape == k.shape and grads[2].shape == v.shape


# ---------------------------------------------------------------------------
# GQA and input dtypes
# ---------------------------------------------------------------------------

def test_gqa_gradients_sum_over_query_heads():
    # dk, dv of kv head g are the sums of the per-query-head gradients with
    # k, v repeated (query head h reads kv head h // group).
    (dout, q, k, v), seed = make_inputs(1, 11, 13, 6, 2, 16)
    dq, dk, dv = attention_backward_naive(dout, q, k, v, causal=True)
    k_rep, v_rep = np.repeat(k, 3, axis=2), np.repeat(v, 3, axis=2)
    dq_r, dk_r, dv_r = attention_backward_naive(dout, q, k_rep, v_rep,
                                                causal=True)
    assert_grads_close(
        (dq, dk, dv),
        (dq_r, dk_r.reshape(1, 13, 2, 3, 16).sum(3),
         dv_r.reshape(1, 13, 2, 3, 16).sum(3)), seed)


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_low_precision_inputs_are_upcast(dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    (dout, q, k, v), seed = make_inputs(1, 13, 21, 4, 2, 64, dtype)
    up = [x.astype(np.float64) for x in (dout, q, k, v)]
    ref = attention_backward_naive(*up, causal=True)
    np.testing.assert_array_equal(
        attention_backward_naive(dout, q, k, v, causal=True)[0], ref[0])
    out, lse = attention_tiled(q, k, v, causal=True)
    grads = attention_backward_tiled(dout, q, k, v, out.astype(dtype),
                                     lse.astype(np.float32), causal=True)
    assert all(g.dtype == np.float64 for g in grads)
    out64, lse64 = attention_tiled(*up[1:], causal=True)
    assert_grads_close(
        attention_backward_tiled(dout, q, k, v, out64, lse64, causal=True),
        ref, seed)


# ---------------------------------------------------------------------------
# attention_grad_lowp
# ---------------------------------------------------------------------------

def rel_err(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(64, 64), (113, 203),
                                               (203, 113)])
def test_lowp_grad_error_small(seqlen_q, seqlen_k, causal):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    (dout, q, k, v), seed = make_inputs(2, seqlen_q, seqlen_k, 4, 2, 64)
    with strict_fp():
        ref = attention_backward_naive(dout, q, k, v, causal=causal)
        out, lse = attention_tiled(q, k, v, causal=causal)
        exact = attention_backward_tiled(dout, q, k, v, out, lse,
                                         causal=causal)
        fp16 = attention_grad_lowp(dout, q, k, v, causal=causal)
        bf16 = attention_grad_lowp(dout, q, k, v, causal=causal,
                                   dtype=ml_dtypes.bfloat16)
    for name, r, e, lo16, lob in zip(("dq", "dk", "dv"), ref, exact, fp16,
                                     bf16):
        assert lo16.dtype == np.float64 and lo16.shape == r.shape
        np.testing.assert_array_equal(lo16, lo16.astype(np.float16))
        np.testing.assert_array_equal(lob, lob.astype(ml_dtypes.bfloat16))
        err64, err16, errb = rel_err(e, r), rel_err(lo16, r), rel_err(lob, r)
        msg = (f"{name}: float64 {err64:.3g}, fp16 {err16:.3g}, "
               f"bf16 {errb:.3g} (seed {seed})")
        # bf16 has 3 fewer mantissa bits than fp16.
        assert err64 < 1e-12 < err16 < 5e-3 and err16 < errb < 3e-2, msg
    if causal and seqlen_q > seqlen_k:
        assert (fp16[0][:, :seqlen_q - seqlen_k] == 0).all()


def test_lowp_grad_bfloat16_by_name_and_scale():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    (dout, q, k, v), seed = make_inputs(1, 31, 31, 2, 1, 64)
    by_type = attention_grad_lowp(dout, q, k, v, softmax_scale=0.05,
                                  dtype=ml_dtypes.bfloat16)
    by_name = attention_grad_lowp(dout, q, k, v, softmax_scale=0.05,
                                  dtype="bfloat16")
    ref = attention_backward_naive(dout, q, k, v, softmax_scale=0.05)
    for a, b, r in zip(by_type, by_name, ref):
        np.testing.assert_array_equal(a, b)
        assert 0 < rel_err(a, r) < 3e-2, f"seed {seed}"


@pytest.mark.filterwarnings("error")
def test_lowp_grad_fully_masked_rows():
    (dout, q, k, v), _ = make_inputs(1, 10, 4, 2, 1, 32)
    with strict_fp():
        dq, dk, dv = attention_grad_lowp(dout, q, k, v, causal=True)
    assert (dq[:, :6] == 0).all()
    assert all(np.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_lowp_grad_error_like_torch_autograd(dtype, causal):
    # The baseline stands for "plain attention in low precision under
    # autograd": its error is the same size as torch's.
    torch = pytest.importorskip("torch")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    np_dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    (dout, q, k, v), seed = make_inputs(2, 113, 203, 4, 2, 64)
    ref = attention_backward_naive(dout, q, k, v, causal=causal)
    ours = attention_grad_lowp(dout, q, k, v, causal=causal, dtype=np_dtype)
    theirs = torch_attention_grads(dout, q, k, v, 1 / 8, causal,
                                   getattr(torch, dtype))
    for name, a, b, r in zip(("dq", "dk", "dv"), ours, theirs, ref):
        ratio = rel_err(a, r) / rel_err(b, r)
        assert 0.67 < ratio < 1.5, f"{name}: ratio {ratio:.3g} (seed {seed})"


# ---------------------------------------------------------------------------
# input validation
# ---------------------------------------------------------------------------

def test_bad_shapes_raise():
    (dout, q, k, v), _ = make_inputs(1, 8, 6, 4, 2, 16)
    out, lse = attention_tiled(q, k, v)
    with pytest.raises(ValueError, match="dout"):
        attention_backward_naive(dout[:, :7], q, k, v)
    with pytest.raises(ValueError, match="dout"):
        attention_grad_lowp(dout[..., :8], q, k, v)
    with pytest.raises(ValueError, match="dout"):
        attention_backward_tiled(dout[:, :, :2], q, k, v, out, lse)
    with pytest.raises(ValueError, match="out"):
        attention_backward_tiled(dout, q, k, v, out[:, :7], lse)
    with pytest.raises(ValueError, match="lse"):
        attention_backward_tiled(dout, q, k, v, out,
                                 np.moveaxis(lse, 1, 2))
    k3 = np.concatenate([k, k[:, :, :1]], axis=2)
    with pytest.raises(ValueError, match="nheads_kv"):
        attention_backward_naive(dout, q, k3, k3)
    with pytest.raises(ValueError, match=r"\bk\b.*\bv\b"):
        attention_backward_tiled(dout, q, k, v[:, :5], out, lse)


@pytest.mark.parametrize("kwargs,name", [
    ({"block_q": 0}, "block_q"),
    ({"block_k": -4}, "block_k"),
    ({"block_q": 2.5}, "block_q"),
    ({"block_k": True}, "block_k"),
])
def test_bad_block_sizes(kwargs, name):
    (dout, q, k, v), _ = make_inputs(1, 8, 8, 2, 2, 16)
    out, lse = attention_tiled(q, k, v)
    with pytest.raises(ValueError, match=name):
        attention_backward_tiled(dout, q, k, v, out, lse, **kwargs)


def test_bad_softmax_scale_and_dtype():
    (dout, q, k, v), _ = make_inputs(1, 4, 4, 1, 1, 8)
    with pytest.raises(ValueError, match="softmax_scale"):
        attention_backward_naive(dout, q, k, v, softmax_scale=math.inf)
    with pytest.raises(ValueError, match="dtype"):
        attention_grad_lowp(dout, q, k, v, dtype=np.float32)


# ---------------------------------------------------------------------------
# non-finite inputs: "NaN in gives NaN out, in the affected rows"
# ---------------------------------------------------------------------------

NONFINITE = [pytest.param(np.nan, id="nan"), pytest.param(np.inf, id="inf"),
             pytest.param(-np.inf, id="-inf")]
NF_SEQLENS = [(12, 12), (9, 17), (19, 11)]


def backward(fn, dout, q, k, v, causal):
    """(dq, dk, dv) of one of the backward functions, under strict_fp (the
    tiled one from attention_tiled's out and lse)."""
    with strict_fp():
        if fn == "naive":
            return attention_backward_naive(dout, q, k, v, causal=causal)
        if fn == "tiled":
            out, lse = attention_tiled(q, k, v, causal=causal, block_m=5,
                                       block_n=4)
            return attention_backward_tiled(dout, q, k, v, out, lse,
                                            causal=causal, block_q=4,
                                            block_k=3)
        return attention_grad_lowp(dout, q, k, v, causal=causal)


def expected_nan_rows(dout, q, k, v, causal):
    """The rule of the reference's module docstring, written densely: the
    NaN rows of (dq (B, Sq, H), dk, dv (B, Sk, Hkv))."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    vis = (causal_mask(seqlen_q, seqlen_k) if causal
           else np.ones((seqlen_q, seqlen_k), dtype=bool)).astype(int)
    has = vis.any(1)

    def bad(x):                           # (B, S, Hx) -> (B, H, S) as int
        b = np.moveaxis(~np.isfinite(x).all(-1), 2, 1)
        return np.repeat(b, q.shape[2] // x.shape[2], 1).astype(int)

    lse_nan = has & ((bad(q) + bad(k) @ vis.T) > 0)       # (B, H, Sq)
    out_nan = lse_nan | (bad(v) @ vis.T > 0)
    do_nan = has & (bad(dout) > 0)
    dq_nan = out_nan | do_nan
    dk_nan = dq_nan.astype(int) @ vis > 0                  # (B, H, Sk)
    dv_nan = (lse_nan | do_nan).astype(int) @ vis > 0

    def kv(x):                            # (B, H, Sk) -> (B, Sk, Hkv)
        b, h, s = x.shape
        return np.moveaxis(x.reshape(b, h // group, group, s).any(2), 1, 2)

    return np.moveaxis(dq_nan, 1, 2), kv(dk_nan), kv(dv_nan)


def assert_grad_rows(grads, clean, nan_rows):
    """Each gradient is NaN on every element of its marked rows, has no NaN
    elsewhere and equals the clean gradient exactly there."""
    for name, g, c, rows in zip(("dq", "dk", "dv"), grads, clean, nan_rows):
        np.testing.assert_array_equal(np.isnan(g).all(-1), rows,
                                      err_msg=f"{name}: NaN rows")
        np.testing.assert_array_equal(~np.isfinite(g).all(-1), rows,
                                      err_msg=f"{name}: non-finite rows")
        np.testing.assert_array_equal(g[~rows], c[~rows], err_msg=name)


@pytest.mark.parametrize("fn", ["naive", "tiled", "lowp"])
@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("which", ["q", "dout"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", NF_SEQLENS)
def test_nonfinite_query_side_row(seqlen_q, seqlen_k, causal, which, value,
                                  fn):
    # One element of the q or dout row (b=1, i, h=2) of a GQA layout (query
    # heads 2, 3 read kv head 1): dq of that row is NaN; dk of every key the
    # row sees (kv head 1 of batch 1) is NaN; dv of those keys too (a NaN q
    # row makes its P row NaN; dv = P^T dO reads dout). Everything else is
    # exactly the clean gradient.
    (dout, q, k, v), seed = make_inputs(2, seqlen_q, seqlen_k, 4, 2, 16)
    clean = backward(fn, dout, q, k, v, causal)
    i = seqlen_q - 4                      # causal: sees all but the last 3 keys
    {"q": q, "dout": dout}[which][1, i, 2, 5] = value
    grads = backward(fn, dout, q, k, v, causal)

    sees = (causal_mask(seqlen_q, seqlen_k)[i] if causal
            else np.ones(seqlen_k, dtype=bool))
    dq_nan = np.zeros(q.shape[:3], dtype=bool)
    dq_nan[1, i, 2] = True
    dk_nan = np.zeros(k.shape[:3], dtype=bool)
    dk_nan[1, :, 1] = sees
    if causal:
        assert 0 < sees.sum() < seqlen_k
    nan_rows = (dq_nan, dk_nan, dk_nan)
    for a, b in zip(nan_rows, expected_nan_rows(dout, q, k, v, causal)):
        np.testing.assert_array_equal(a, b)
    assert_grad_rows(grads, clean, nan_rows)


@pytest.mark.parametrize("fn", ["naive", "tiled", "lowp"])
@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", NF_SEQLENS)
def test_nonfinite_key_side_row(seqlen_q, seqlen_k, causal, which, value,
                                fn):
    # One element of the k or v row (b=0, j, kv head 1): the query rows of
    # heads 2, 3 that see key j are affected, so their dq is NaN, and dk of
    # every key such a row sees; dv of those keys too for k (the rows' P is
    # NaN) but not for v (dv = P^T dO does not read v). Rows that do not see
    # key j (causal: the rows before it) and the other batch are exact.
    (dout, q, k, v), seed = make_inputs(2, seqlen_q, seqlen_k, 4, 2, 16)
    clean = backward(fn, dout, q, k, v, causal)
    j = seqlen_k - 3
    {"k": k, "v": v}[which][0, j, 1, 7] = value
    grads = backward(fn, dout, q, k, v, causal)

    vis = (causal_mask(seqlen_q, seqlen_k) if causal
           else np.ones((seqlen_q, seqlen_k), dtype=bool))
    rows = vis[:, j]                      # query rows that see key j
    keys = vis[rows].any(0)               # keys those rows see
    if causal:
        assert 0 < rows.sum() < seqlen_q
    dq_nan = np.zeros(q.shape[:3], dtype=bool)
    dq_nan[0, :, 2] = dq_nan[0, :, 3] = rows
    dk_nan = np.zeros(k.shape[:3], dtype=bool)
    dk_nan[0, :, 1] = keys
    dv_nan = dk_nan if which == "k" else np.zeros_like(dk_nan)
    nan_rows = (dq_nan, dk_nan, dv_nan)
    for a, b in zip(nan_rows, expected_nan_rows(dout, q, k, v, causal)):
        np.testing.assert_array_equal(a, b)
    assert_grad_rows(grads, clean, nan_rows)


@pytest.mark.parametrize("fn", ["naive", "tiled", "lowp"])
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_everywhere(fn, causal):
    # Several non-finite values in every input at once (MQA and GQA): the
    # NaN rows are the rule's, the rest exact, no warning.
    rng = np.random.default_rng(11)
    for nheads_kv in (1, 2):
        (dout, q, k, v), seed = make_inputs(2, 21, 15, 4, nheads_kv, 8)
        clean = backward(fn, dout, q, k, v, causal)
        for x in (dout, q, k, v):
            idx = tuple(rng.integers(0, n, 2) for n in x.shape)
            x[idx] = rng.choice([np.nan, np.inf, -np.inf], 2)
        grads = backward(fn, dout, q, k, v, causal)
        assert_grad_rows(grads, clean,
                         expected_nan_rows(dout, q, k, v, causal))


@pytest.mark.parametrize("fn", ["naive", "tiled", "lowp"])
def test_nonfinite_in_fully_masked_rows_contribute_nothing(fn):
    # q and dout rows that see no key are not read: NaN / inf there changes
    # nothing (dq stays 0 there) and raises no warning.
    seqlen_q, seqlen_k = 20, 6            # causal: rows 0..13 see no key
    (dout, q, k, v), seed = make_inputs(2, seqlen_q, seqlen_k, 4, 2, 32)
    clean = backward(fn, dout, q, k, v, True)
    q[:, 0:14:2] = np.nan
    dout[:, 1:14:2] = np.inf
    dout[:, 2:14:5, :, 0] = np.nan
    grads = backward(fn, dout, q, k, v, True)
    for g, c in zip(grads, clean):
        np.testing.assert_array_equal(g, c)
    assert (grads[0][:, :14] == 0).all()


@pytest.mark.parametrize("what", ["out-nan", "out-inf", "lse-nan",
                                  "lse-neginf", "lse-posinf"])
def test_tiled_reads_out_and_lse_rows(what):
    # The tiled backward also reads the given out and lse row by row: a
    # non-finite out row makes its D row NaN (so dq of the row and dk of the
    # keys it sees, not dv); a NaN or -inf lse makes its P row NaN (dv as
    # well). +inf is the fully masked LSE: the row contributes nothing.
    (dout, q, k, v), seed = make_inputs(1, 10, 10, 2, 1, 16)
    out, lse = attention_tiled(q, k, v, causal=True)
    with strict_fp():
        clean = attention_backward_tiled(dout, q, k, v, out, lse, causal=True,
                                         block_q=3, block_k=4)
    i = 6                                 # sees keys 0..6
    name, val = what.split("-")
    val = {"nan": np.nan, "inf": np.inf, "neginf": -np.inf,
           "posinf": np.inf}[val]
    if name == "out":
        out[0, i, 1, 2] = val
    else:
        lse[0, 1, i] = val
    with strict_fp():
        grads = attention_backward_tiled(dout, q, k, v, out, lse, causal=True,
                                         block_q=3, block_k=4)
    dq_nan = np.zeros(q.shape[:3], dtype=bool)
    dk_nan = np.zeros(k.shape[:3], dtype=bool)
    if what == "lse-posinf":
        # Row i is dropped (P = 0): dq of the row is 0, nothing is NaN.
        assert all(np.isfinite(g).all() for g in grads)
        assert (grads[0][0, i, 1] == 0).all()
        return
    dq_nan[0, i, 1] = True
    dk_nan[0, :i + 1, 0] = True
    dv_nan = dk_nan if name == "lse" else np.zeros_like(dk_nan)
    assert_grad_rows(grads, clean, (dq_nan, dk_nan, dv_nan))


@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("nheads,nheads_kv", [(4, 4), (4, 2), (4, 1)])
def test_nonfinite_grads_match_torch_sdpa(nheads, nheads_kv, which, value):
    # torch's math SDPA under autograd (float64, CPU): the same gradient rows
    # hold a non-finite value and the others agree. Documented differences:
    # torch gives +-inf or a NaN column where we give a NaN row (same rows);
    # a +-inf in k leaves torch finite where that key's score is -inf (its
    # rows are then a subset of ours). Non-causal: with is_causal, torch's
    # masked entries leak NaN into the gradients of rows and keys that never
    # see the non-finite value (0 * NaN), which the reference does not copy.
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    (dout, q, k, v), seed = make_inputs(2, 14, 18, nheads, nheads_kv, 32)
    {"q": q, "k": k, "v": v, "dout": dout}[which][1, 5, 0, 3] = value
    with strict_fp():
        grads = attention_backward_naive(dout, q, k, v)
    group = nheads // nheads_kv
    tq, tk, tv = (torch.from_numpy(np.moveaxis(x, 2, 1).copy()).requires_grad_()
                  for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        t_out = torch.nn.functional.scaled_dot_product_attention(
            tq, tk.repeat_interleave(group, 1), tv.repeat_interleave(group, 1))
    t_out.backward(torch.from_numpy(np.moveaxis(dout, 2, 1).copy()))
    theirs = [np.moveaxis(t.grad.numpy(), 1, 2) for t in (tq, tk, tv)]
    for name, g, t in zip(("dq", "dk", "dv"), grads, theirs):
        ours_nan = np.isnan(g).all(-1)
        assert np.isfinite(g[~ours_nan]).all(), name
        theirs_bad = ~np.isfinite(t).all(-1)
        if which == "k" and np.isinf(value):
            assert (theirs_bad <= ours_nan).all(), name
        else:
            np.testing.assert_array_equal(ours_nan, theirs_bad, err_msg=name)
        tol = 1e-10 * max(1.0, float(np.abs(t[~ours_nan]).max(initial=0.0)))
        np.testing.assert_allclose(g[~ours_nan], t[~ours_nan], rtol=1e-10,
                                   atol=tol, err_msg=f"{name} (seed {seed})")
    assert np.isnan(grads[1]).any()
