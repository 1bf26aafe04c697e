"""CPU tests of cuflash.reference's flash-attn 2.8 features: local window, softcap, ALiBi,
dropout (given mask) and variable-length (packed) sequences, forward and backward."""

import numpy as np
import pytest

from cuflash.reference import (
    attention_backward_naive,
    attention_backward_tiled,
    attention_backward_varlen_naive,
    attention_grad_lowp,
    attention_naive,
    attention_tiled,
    attention_varlen_naive,
    lowp_attention,
    window_mask,
)
from conftest import strict_fp


def _inputs(b, sq, sk, h, hkv, d, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, hkv, d)),
            rng.standard_normal((b, sk, hkv, d)), rng.standard_normal((b, sq, h, d)))


def brute_keep(sq, sk, left, right, causal):
    keep = np.zeros((sq, sk), dtype=bool)
    if causal:
        right = 0
    for i in range(sq):
        for j in range(sk):
            ok = True
            if left >= 0 and j < i + sk - sq - left:
                ok = False
            if right >= 0 and j > i + sk - sq + right:
                ok = False
            keep[i, j] = ok
    return keep


def loop_attention(q, k, v, scale=None, keep=None, softcap=0.0, slopes=None, drop=None, p=0.0):
    """Row-by-row float64 oracle: (out, lse) with an explicit keep mask (Sq, Sk)."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(d) if scale is None else scale
    out = np.zeros(q.shape)
    lse = np.full((b, h, sq), np.inf)
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // hkv)
            for i in range(sq):
                s = []
                js = [j for j in range(sk) if keep is None or keep[i, j]]
                for j in js:
                    x = scale * float(q[bi, i, hi] @ k[bi, j, g])
                    if softcap > 0:
                        x = softcap * np.tanh(x / softcap)
                    if slopes is not None:
                        x -= slopes[bi, hi] * abs(i + sk - sq - j)
                    s.append(x)
                if not js:
                    continue
                s = np.array(s)
                m = s.max()
                e = np.exp(s - m)
                lse[bi, hi, i] = m + np.log(e.sum())
                pr = e / e.sum()
                for t, j in enumerate(js):
                    w = pr[t]
                    if drop is not None:
                        w = w * drop[bi, hi, i, j] / (1 - p)
                    out[bi, i, hi] += w * v[bi, j, g]
    return out, lse


WINDOWS = [(-1, -1), (0, 0), (2, 0), (3, 1), (-1, 2), (1, -1), (0, 5), (20, 20)]


@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 9), (9, 4), (1, 6), (6, 1)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_window_matches_brute_mask(sq, sk, window, causal):
    keep = brute_keep(sq, sk, *window, causal)
    np.testing.assert_array_equal(window_mask(sq, sk, window, causal), keep)
    q, k, v, do = _inputs(2, sq, sk, 4, 2, 8)
    with strict_fp():
        out, lse = attention_naive(q, k, v, causal=causal, return_lse=True, window_size=window)
        out_t, lse_t = attention_tiled(q, k, v, causal=causal, block_m=3, block_n=2,
                                       window_size=window)
    ref_out, ref_lse = loop_attention(q, k, v, keep=keep)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-12)
    np.testing.assert_allclose(out_t, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse_t, lse, rtol=1e-12)     # +inf rows equal
    # Fully masked rows: zero output, +inf lse, zero gradients.
    empty = ~keep.any(axis=1)
    assert np.all(out[:, empty] == 0)
    with strict_fp():
        dq, dk, dv = attention_backward_naive(do, q, k, v, causal=causal, window_size=window)
        g_t = attention_backward_tiled(do, q, k, v, out, lse, causal=causal, block_q=2,
                                       block_k=3, window_size=window)
    assert np.all(dq[:, empty] == 0)
    for a, b in zip((dq, dk, dv), g_t):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12)
    # Keys no row sees get zero dk / dv.
    unseen = ~keep.any(axis=0)
    assert np.all(dk[:, unseen] == 0) and np.all(dv[:, unseen] == 0)


def test_causal_equals_right_zero():
    q, k, v, do = _inputs(1, 6, 9, 2, 1, 4)
    for left in (-1, 0, 2):
        a = attention_naive(q, k, v, causal=True, return_lse=True, window_size=(left, -1))
        b = attention_naive(q, k, v, return_lse=True, window_size=(left, 0))
        c = attention_naive(q, k, v, causal=True, return_lse=True, window_size=(left, 4))
        for x, y, z in zip(a, b, c):
            np.testing.assert_array_equal(x, y)
            np.testing.assert_array_equal(x, z)
    np.testing.assert_array_equal(attention_naive(q, k, v, causal=True),
                                  attention_naive(q, k, v, window_size=(-1, 0)))


@pytest.mark.parametrize("softcap", [0.5, 3.0, 50.0])
def test_softcap_direct_formula(softcap):
    q, k, v, _ = _inputs(2, 5, 7, 2, 2, 4)
    q = q * 3
    scale = 0.7
    with strict_fp():
        out, lse = attention_naive(q, k, v, scale, return_lse=True, softcap=softcap)
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    s = softcap * np.tanh(s / softcap)
    ref_lse = np.log(np.exp(s).sum(-1))
    pr = np.exp(s - ref_lse[..., None])
    ref = np.einsum("bhij,bjhd->bihd", pr, v)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    ref2, _ = loop_attention(q, k, v, scale, softcap=softcap)
    np.testing.assert_allclose(out, ref2, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("slopes_shape", ["h", "bh"])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi_matches_loop(slopes_shape, causal):
    b, sq, sk, h = 2, 5, 8, 4
    q, k, v, do = _inputs(b, sq, sk, h, 2, 4)
    rng = np.random.default_rng(1)
    slopes = rng.uniform(0.05, 1.0, (h,) if slopes_shape == "h" else (b, h)).astype(np.float32)
    with strict_fp():
        out, lse = attention_naive(q, k, v, causal=causal, return_lse=True, alibi_slopes=slopes)
        out_t, lse_t = attention_tiled(q, k, v, causal=causal, block_m=2, block_n=3,
                                       alibi_slopes=slopes)
    ref, ref_lse = loop_attention(q, k, v, keep=brute_keep(sq, sk, -1, -1, causal),
                                  slopes=np.broadcast_to(slopes.astype(np.float64), (b, h)))
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    np.testing.assert_allclose(out_t, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse_t, ref_lse, rtol=1e-12)


def _mask(shape, p, seed=2):
    return np.random.default_rng(seed).random(shape) >= p


def test_dropout_matches_manual():
    b, sq, sk, h = 2, 6, 5, 2
    q, k, v, _ = _inputs(b, sq, sk, h, 1, 4)
    p = 0.3
    mask = _mask((b, h, sq, sk), p)
    with strict_fp():
        out, lse = attention_naive(q, k, v, return_lse=True, dropout_p=p, dropout_mask=mask)
        out_t, lse_t = attention_tiled(q, k, v, block_m=4, block_n=2, dropout_p=p,
                                       dropout_mask=mask)
    _, lse0 = attention_naive(q, k, v, return_lse=True)
    np.testing.assert_array_equal(lse, lse0)        # LSE of the undropped softmax
    ref, _ = loop_attention(q, k, v, drop=mask, p=p)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(out_t, ref, rtol=1e-12, atol=1e-13)
    # All-kept mask with p = 0 is no dropout.
    np.testing.assert_array_equal(
        attention_naive(q, k, v, dropout_mask=np.ones((b, h, sq, sk), bool)),
        attention_naive(q, k, v))


COMBO = dict(window_size=(3, 1), softcap=2.0, dropout_p=0.25)


def _combo_kwargs(b, h, sq, sk):
    return dict(COMBO, alibi_slopes=np.linspace(0.1, 0.8, b * h).reshape(b, h).astype(np.float32),
                dropout_mask=_mask((b, h, sq, sk), COMBO["dropout_p"], seed=5))


@pytest.mark.parametrize("causal", [False, True])
def test_all_combined(causal):
    b, sq, sk, h = 2, 7, 9, 4
    q, k, v, do = _inputs(b, sq, sk, h, 2, 4)
    kw = _combo_kwargs(b, h, sq, sk)
    with strict_fp():
        out, lse = attention_naive(q, k, v, 0.6, causal, True, **kw)
        out_t, lse_t = attention_tiled(q, k, v, 0.6, causal, 3, 4, **kw)
        g = attention_backward_naive(do, q, k, v, 0.6, causal, **kw)
        g_t = attention_backward_tiled(do, q, k, v, out, lse, 0.6, causal, 2, 3, **kw)
    ref, ref_lse = loop_attention(q, k, v, 0.6, keep=brute_keep(sq, sk, 3, 1, causal),
                                  softcap=2.0, slopes=kw["alibi_slopes"].astype(np.float64),
                                  drop=kw["dropout_mask"], p=0.25)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    np.testing.assert_allclose(out_t, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse_t, ref_lse, rtol=1e-12)
    for a, bb in zip(g, g_t):
        np.testing.assert_allclose(bb, a, rtol=1e-10, atol=1e-12)


# --- gradients vs central finite differences --------------------------------

GRAD_CASES = {
    "window": dict(window_size=(2, 1)),
    "causal_window": dict(causal=True, window_size=(1, -1)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes=np.array([0.3, 0.9], np.float32)),
    "dropout": dict(dropout_p=0.4),
    "combined": dict(causal=True, window_size=(3, -1), softcap=1.0,
                     alibi_slopes=np.array([[0.2, 0.5], [0.7, 0.1]], np.float32),
                     dropout_p=0.2),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradients_finite_differences(name):
    b, sq, sk, h, hkv, d = 2, 5, 6, 2, 1, 3
    q, k, v, do = _inputs(b, sq, sk, h, hkv, d, seed=3)
    q = q * 1.5
    kw = dict(GRAD_CASES[name])
    causal = kw.pop("causal", False)
    if kw.get("dropout_p"):
        kw["dropout_mask"] = _mask((b, h, sq, sk), kw["dropout_p"], seed=4)

    def loss(q_, k_, v_):
        return float(np.sum(attention_naive(q_, k_, v_, None, causal, **kw) * do))

    with strict_fp():
        grads = attention_backward_naive(do, q, k, v, None, causal, **kw)
    eps = 1e-6
    rng = np.random.default_rng(7)
    inputs = [q, k, v]
    for which in range(3):
        x = inputs[which]
        for _ in range(6):
            idx = tuple(rng.integers(0, n) for n in x.shape)
            plus = [a.copy() for a in inputs]
            minus = [a.copy() for a in inputs]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            fd = (loss(*plus) - loss(*minus)) / (2 * eps)
            assert abs(grads[which][idx] - fd) <= 1e-6 * max(1.0, abs(fd)), (name, which, idx)


# --- variable length ---------------------------------------------------------

@pytest.mark.parametrize("features", ["plain", "causal", "combined"])
def test_varlen_matches_dense(features):
    lens_q = [3, 0, 1, 5, 2, 0]
    lens_k = [4, 2, 1, 3, 0, 0]
    h, hkv, d = 4, 2, 5
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    rng = np.random.default_rng(9)
    q = rng.standard_normal((cu_q[-1], h, d))
    k = rng.standard_normal((cu_k[-1], hkv, d))
    v = rng.standard_normal((cu_k[-1], hkv, d))
    do = rng.standard_normal(q.shape)
    causal = features != "plain"
    kw = {}
    masks = None
    if features == "combined":
        slopes = rng.uniform(0.1, 1, (len(lens_q), h)).astype(np.float32)
        masks = [_mask((h, a, c), 0.3, seed=i) for i, (a, c) in enumerate(zip(lens_q, lens_k))]
        kw = dict(window_size=(1, -1), softcap=2.5, dropout_p=0.3, dropout_mask=masks,
                  alibi_slopes=slopes)
    with strict_fp():
        out, lse = attention_varlen_naive(q, k, v, cu_q, cu_k, 0.5, causal, True, **kw)
        dq, dk, dv = attention_backward_varlen_naive(do, q, k, v, cu_q, cu_k, 0.5, causal, **kw)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    for bi in range(len(lens_q)):
        sq_, sk_ = slice(cu_q[bi], cu_q[bi + 1]), slice(cu_k[bi], cu_k[bi + 1])
        kb = {}
        if features == "combined":
            kb = dict(window_size=(1, -1), softcap=2.5, dropout_p=0.3,
                      dropout_mask=masks[bi][None], alibi_slopes=kw["alibi_slopes"][bi])
        o, l = attention_naive(q[None, sq_], k[None, sk_], v[None, sk_], 0.5, causal, True, **kb)
        g = attention_backward_naive(do[None, sq_], q[None, sq_], k[None, sk_], v[None, sk_],
                                     0.5, causal, **kb)
        np.testing.assert_array_equal(out[sq_], o[0])
        np.testing.assert_array_equal(lse[:, sq_], l[0])
        np.testing.assert_array_equal(dq[sq_], g[0][0])
        np.testing.assert_array_equal(dk[sk_], g[1][0])
        np.testing.assert_array_equal(dv[sk_], g[2][0])
    # The row with no key (sequence with lens_k = 0) is fully masked.
    assert np.all(out[cu_q[4]:cu_q[5]] == 0) and np.all(np.isinf(lse[:, cu_q[4]:cu_q[5]]))
    np.testing.assert_array_equal(attention_varlen_naive(q, k, v, cu_q, cu_k, 0.5, causal, **kw),
                                  out)


def test_varlen_empty_batch():
    q = np.zeros((0, 2, 4))
    k = np.zeros((0, 1, 4))
    out, lse = attention_varlen_naive(q, k, k, [0], [0], return_lse=True)
    assert out.shape == (0, 2, 4) and lse.shape == (2, 0)


# --- lowp baselines with features ---------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_lowp_features_close_to_reference(causal):
    b, sq, sk, h = 2, 16, 24, 4
    q, k, v, do = _inputs(b, sq, sk, h, 2, 16)
    kw = _combo_kwargs(b, h, sq, sk)
    with strict_fp():
        ref = attention_naive(q, k, v, None, causal, **kw)
        low = lowp_attention(q, k, v, None, causal, np.float16, **kw)
        g = attention_backward_naive(do, q, k, v, None, causal, **kw)
        gl = attention_grad_lowp(do, q, k, v, None, causal, np.float16, **kw)
    assert np.max(np.abs(low - ref)) < 1e-2
    for a, bb in zip(g, gl):
        assert np.max(np.abs(a - bb)) < 3e-2
    assert not np.array_equal(low, ref)


# --- NaN rule with a window ---------------------------------------------------

def test_nan_rule_with_window():
    q, k, v, do = _inputs(1, 6, 6, 1, 1, 4)
    k = k.copy()
    k[0, 0, 0, 0] = np.nan                 # key 0: seen by rows 0..1 with window (1, 0)
    with strict_fp():
        out, lse = attention_naive(q, k, v, return_lse=True, window_size=(1, 0))
        dq, dk, dv = attention_backward_naive(do, q, k, v, window_size=(1, 0))
    nan_rows = np.isnan(out[0, :, 0, 0])
    np.testing.assert_array_equal(nan_rows, [True, True, False, False, False, False])
    np.testing.assert_array_equal(np.isnan(dk[0, :, 0, 0]), [True, True, False, False, False, False])
    np.testing.assert_array_equal(np.isnan(dq[0, :, 0, 0]), nan_rows)


# --- bad arguments -------------------------------------------------------------

BAD = [
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(window_size=(1,)), "window_size"),
    (dict(window_size=(1.5, 0)), "window_size"),
    (dict(window_size=None), "window_size"),
    (dict(window_size=(True, 0)), "window_size"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("inf")), "softcap"),
    (dict(softcap=float("nan")), "softcap"),
    (dict(alibi_slopes=np.ones(3, np.float32)), "alibi_slopes"),
    (dict(alibi_slopes=np.ones((3, 2), np.float32)), "alibi_slopes"),
    (dict(alibi_slopes=np.array([np.nan, 1.0])), "alibi_slopes"),
    (dict(dropout_p=1.0), "dropout_p"),
    (dict(dropout_p=-0.1), "dropout_p"),
    (dict(dropout_p=0.5), "dropout_mask"),
    (dict(dropout_p=0.5, dropout_mask=np.ones((2, 2, 3, 4))), "dropout_mask"),
    (dict(dropout_p=0.5, dropout_mask=np.ones((2, 2, 4, 3), bool)), "dropout_mask"),
    (dict(dropout_mask=np.zeros((2, 2, 3, 4), bool)), "dropout_mask"),
]


@pytest.mark.parametrize("kw,name", BAD)
def test_bad_arguments(kw, name):
    q, k, v, do = _inputs(2, 3, 4, 2, 1, 4)
    for fn in (lambda: attention_naive(q, k, v, **kw),
               lambda: attention_backward_naive(do, q, k, v, **kw),
               lambda: attention_tiled(q, k, v, **kw),
               lambda: lowp_attention(q, k, v, **kw),
               lambda: attention_grad_lowp(do, q, k, v, **kw)):
        with pytest.raises(ValueError, match=name):
            fn()


@pytest.mark.parametrize("cu_q,cu_k,name", [
    ([0, 2, 5], [0, 6], "cu_seqlens_q and cu_seqlens_k"),
    ([1, 2, 5], [0, 3, 6], "cu_seqlens_q"),
    ([0, 3, 2, 5], [0, 3, 4, 6], "cu_seqlens_q"),
    ([0, 2, 4], [0, 3, 6], "cu_seqlens_q"),
    ([0, 2, 5], [0, 3, 7], "cu_seqlens_k"),
    (np.array([0.0, 2.0, 5.0]), [0, 3, 6], "cu_seqlens_q"),
])
def test_bad_cu_seqlens(cu_q, cu_k, name):
    q = np.zeros((5, 2, 4))
    k = np.zeros((6, 1, 4))
    with pytest.raises(ValueError, match=name):
        attention_varlen_naive(q, k, k, cu_q, cu_k)
    with pytest.raises(ValueError, match=name):
        attention_backward_varlen_naive(q, q, k, k, cu_q, cu_k)


def test_bad_varlen_dropout_mask():
    q = np.zeros((5, 2, 4))
    k = np.zeros((6, 1, 4))
    cu_q, cu_k = [0, 2, 5], [0, 3, 6]
    with pytest.raises(ValueError, match="dropout_mask"):
        attention_varlen_naive(q, k, k, cu_q, cu_k, dropout_p=0.5)
    with pytest.raises(ValueError, match="dropout_mask"):
        attention_varlen_naive(q, k, k, cu_q, cu_k, dropout_p=0.5,
                               dropout_mask=[np.ones((2, 2, 3), bool)])
    with pytest.raises(ValueError, match=r"dropout_mask\[1\]"):
        attention_varlen_naive(q, k, k, cu_q, cu_k, dropout_p=0.5,
                               dropout_mask=[np.ones((2, 2, 3), bool), np.ones((2, 2, 3), bool)])
    with pytest.raises(ValueError, match="window_size"):
        attention_varlen_naive(q, k, k, cu_q, cu_k, window_size=(0, -3))


# --- torch's math SDPA with an explicit float mask ------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_sdpa_float_mask(causal):
    torch = pytest.importorskip("torch")
    b, sq, sk, h, hkv, d = 2, 6, 9, 4, 2, 8
    q, k, v, do = _inputs(b, sq, sk, h, hkv, d)
    slopes = np.linspace(0.1, 0.9, h).astype(np.float32)
    window = (3, 2)
    kw = dict(window_size=window, alibi_slopes=slopes)
    out = attention_naive(q, k, v, None, causal, **kw)
    dq, dk, dv = attention_backward_naive(do, q, k, v, None, causal, **kw)

    keep = brute_keep(sq, sk, *window, causal)
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    bias = -slopes.astype(np.float64)[:, None, None] * np.abs(i + sk - sq - j)
    bias = np.where(keep, bias, -np.inf)[None]                    # (1, H, Sq, Sk)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    group = h // hkv
    o = torch.nn.functional.scaled_dot_product_attention(
        tq.transpose(1, 2), tk.transpose(1, 2).repeat_interleave(group, 1),
        tv.transpose(1, 2).repeat_interleave(group, 1), attn_mask=torch.tensor(bias))
    o = o.transpose(1, 2)
    o.backward(torch.tensor(do))
    # Rows with no key: torch gives NaN; we give 0.
    rows = keep.any(axis=1)
    np.testing.assert_allclose(out[:, rows], o.detach().numpy()[:, rows], rtol=1e-10, atol=1e-12)
    if rows.all():
        np.testing.assert_allclose(dq, tq.grad.numpy(), rtol=1e-9, atol=1e-11)
        np.testing.assert_allclose(dk, tk.grad.numpy(), rtol=1e-9, atol=1e-11)
        np.testing.assert_allclose(dv, tv.grad.numpy(), rtol=1e-9, atol=1e-11)
