"""CPU tests for cuflash.reference (the float64 attention oracle)."""

import math

import numpy as np
import pytest

from cuflash.reference import (
    attention_naive,
    attention_tiled,
    causal_mask,
    lowp_attention,
)
from conftest import random_attention_inputs, strict_fp


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim,
             dtype=np.float64):
    (q, k, v, _), _ = random_attention_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype)
    return q, k, v


def loop_reference(q, k, v, softmax_scale=None, causal=False):
    """Independent per-(batch, head, row) implementation for cross-checks."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    out = np.zeros_like(q)
    lse = np.full((batch, nheads, seqlen_q), np.inf)
    for b in range(batch):
        for h in range(nheads):
            hk = h // group
            for i in range(seqlen_q):
                if causal:
                    # Bottom-right alignment: the last query row sees all keys.
                    last = i + (seqlen_k - seqlen_q)
                    n_keys = max(0, min(seqlen_k, last + 1))
                else:
                    n_keys = seqlen_k
                if n_keys == 0:
                    continue
                scores = np.array([
                    scale * float(np.dot(q[b, i, h], k[b, j, hk]))
                    for j in range(n_keys)
                ])
                top = scores.max()
                w = np.exp(scores - top)
                total = w.sum()
                out[b, i, h] = (w[:, None] * v[b, :n_keys, hk]).sum(0) / total
                lse[b, h, i] = top + math.log(total)
    return out, lse


def assert_lse_close(lse, ref, rtol=1e-10, atol=1e-10):
    assert lse.shape == ref.shape
    assert lse.dtype == np.float64
    assert not np.isnan(lse).any()
    inf_a = np.isinf(lse)
    inf_b = np.isinf(ref)
    np.testing.assert_array_equal(inf_a, inf_b)
    assert (lse[inf_a] > 0).all(), "masked rows must have lse == +inf"
    np.testing.assert_allclose(lse[~inf_a], ref[~inf_b], rtol=rtol, atol=atol)


def check_tiled_vs_naive(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim,
                         causal, block_m, block_n):
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim)
    with strict_fp():
        o_ref, lse_ref = attention_naive(q, k, v, causal=causal,
                                         return_lse=True)
        o, lse = attention_tiled(q, k, v, causal=causal, block_m=block_m,
                                 block_n=block_n)
    assert o.shape == q.shape and o.dtype == np.float64
    assert lse.shape == (batch, nheads, seqlen_q)
    assert not np.isnan(o).any()
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-10)
    assert_lse_close(lse, lse_ref)


# ---------------------------------------------------------------------------
# causal_mask
# ---------------------------------------------------------------------------

def test_causal_mask_square_is_lower_triangular():
    np.testing.assert_array_equal(causal_mask(5, 5),
                                  np.tril(np.ones((5, 5), dtype=bool)))


def test_causal_mask_bottom_right_alignment():
    assert causal_mask(2, 4).dtype == bool
    np.testing.assert_array_equal(
        causal_mask(2, 4),
        [[True, True, True, False],
         [True, True, True, True]])
    np.testing.assert_array_equal(
        causal_mask(4, 2),
        [[False, False],
         [False, False],
         [True, False],
         [True, True]])


# ---------------------------------------------------------------------------
# tiled vs naive
# ---------------------------------------------------------------------------

SMALL_SEQLENS = [(1, 1), (17, 17), (113, 203), (203, 113)]
HEADDIMS = [32, 64, 96, 128, 160, 256]
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
BLOCKS = [(64, 64), (16, 48)]


@pytest.mark.parametrize("block_m,block_n", BLOCKS)
@pytest.mark.parametrize("nheads,nheads_kv", HEADS)
@pytest.mark.parametrize("headdim", HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SMALL_SEQLENS)
def test_tiled_matches_naive_small(seqlen_q, seqlen_k, causal, headdim, nheads,
                                   nheads_kv, block_m, block_n):
    check_tiled_vs_naive(2, seqlen_q, seqlen_k, nheads, nheads_kv, headdim,
                         causal, block_m, block_n)


@pytest.mark.parametrize("block_m,block_n", BLOCKS)
@pytest.mark.parametrize("nheads,nheads_kv", [(2, 2), (4, 1)])
@pytest.mark.parametrize("headdim", [64, 160, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k",
                         [(1023, 1023), (1, 1023), (1023, 17)])
def test_tiled_matches_naive_long(seqlen_q, seqlen_k, causal, headdim, nheads,
                                  nheads_kv, block_m, block_n):
    check_tiled_vs_naive(1, seqlen_q, seqlen_k, nheads, nheads_kv, headdim,
                         causal, block_m, block_n)


@pytest.mark.parametrize("block_m,block_n", [(1, 1), (7, 5), (64, 16),
                                             (128, 128), (300, 300)])
def test_tiled_odd_blocks(block_m, block_n):
    # Blocks that do not divide the sequence lengths, and larger than them.
    for causal in (False, True):
        check_tiled_vs_naive(1, 37, 53, 4, 2, 32, causal, block_m, block_n)
        check_tiled_vs_naive(1, 53, 37, 4, 2, 32, causal, block_m, block_n)


# ---------------------------------------------------------------------------
# naive vs an independent loop implementation
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads,nheads_kv", HEADS)
@pytest.mark.parametrize("seqlen_q,seqlen_k",
                         [(1, 1), (5, 9), (9, 5), (16, 16), (23, 7), (1, 13)])
def test_naive_matches_loop(seqlen_q, seqlen_k, nheads, nheads_kv, causal):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_kv, 32)
    with strict_fp():
        o, lse = attention_naive(q, k, v, causal=causal, return_lse=True)
    o_ref, lse_ref = loop_reference(q, k, v, causal=causal)
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-10)
    assert_lse_close(lse, lse_ref)


def test_gqa_head_mapping():
    # Query head h must read kv head h // (nheads // nheads_kv): compare each
    # query head against a single-head computation with the expected kv head.
    q, k, v = make_qkv(1, 11, 13, 6, 3, 16)
    o, lse = attention_naive(q, k, v, return_lse=True)
    for h in range(6):
        hk = h // 2
        o_h, lse_h = attention_naive(q[:, :, h:h + 1], k[:, :, hk:hk + 1],
                                     v[:, :, hk:hk + 1], return_lse=True)
        np.testing.assert_allclose(o[:, :, h:h + 1], o_h, rtol=1e-12,
                                   atol=1e-12)
        np.testing.assert_allclose(lse[:, h:h + 1], lse_h, rtol=1e-12)


@pytest.mark.parametrize("fn", ["naive", "tiled"])
def test_fully_masked_rows(fn):
    # seqlen_q > seqlen_k with causal: rows i < seqlen_q - seqlen_k see nothing.
    seqlen_q, seqlen_k = 20, 6
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 32)
    with strict_fp():
        if fn == "naive":
            o, lse = attention_naive(q, k, v, causal=True, return_lse=True)
        else:
            o, lse = attention_tiled(q, k, v, causal=True, block_m=8,
                                     block_n=4)
    n_empty = seqlen_q - seqlen_k
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert (o[:, :n_empty] == 0).all()
    assert np.isposinf(lse[:, :, :n_empty]).all()
    assert np.isfinite(lse[:, :, n_empty:]).all()
    assert (np.abs(o[:, n_empty:]).sum(-1) > 0).all()
    o_ref, lse_ref = loop_reference(q, k, v, causal=True)
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-10)
    assert_lse_close(lse, lse_ref)


def test_entire_q_block_masked_in_tiled():
    # Whole Q blocks without keys: the tiled loop visits no K/V block for them.
    q, k, v = make_qkv(1, 200, 30, 2, 1, 64)
    with strict_fp():
        o, lse = attention_tiled(q, k, v, causal=True, block_m=64, block_n=64)
        o_ref, lse_ref = attention_naive(q, k, v, causal=True,
                                         return_lse=True)
    assert (o[:, :170] == 0).all() and np.isposinf(lse[:, :, :170]).all()
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-10)
    assert_lse_close(lse, lse_ref)


def test_non_causal_rows_are_never_empty():
    q, k, v = make_qkv(1, 30, 3, 2, 2, 32)
    _, lse = attention_naive(q, k, v, causal=False, return_lse=True)
    assert np.isfinite(lse).all()


# ---------------------------------------------------------------------------
# softmax_scale
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_explicit_softmax_scale(causal):
    q, k, v = make_qkv(2, 19, 27, 4, 2, 64)
    scale = 0.37
    o_ref, lse_ref = loop_reference(q, k, v, softmax_scale=scale, causal=causal)
    o, lse = attention_naive(q, k, v, softmax_scale=scale, causal=causal,
                             return_lse=True)
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-10)
    assert_lse_close(lse, lse_ref)
    o_t, lse_t = attention_tiled(q, k, v, softmax_scale=scale, causal=causal,
                                 block_m=16, block_n=48)
    np.testing.assert_allclose(o_t, o_ref, rtol=1e-10, atol=1e-10)
    assert_lse_close(lse_t, lse_ref)
    # The scale actually matters.
    assert not np.allclose(o, attention_naive(q, k, v, causal=causal))


@pytest.mark.parametrize("headdim", [32, 96, 256])
def test_default_softmax_scale(headdim):
    q, k, v = make_qkv(1, 9, 14, 2, 1, headdim)
    explicit = 1.0 / math.sqrt(headdim)
    o, lse = attention_naive(q, k, v, return_lse=True)
    o_e, lse_e = attention_naive(q, k, v, softmax_scale=explicit,
                                 return_lse=True)
    np.testing.assert_array_equal(o, o_e)
    np.testing.assert_array_equal(lse, lse_e)
    o_t, lse_t = attention_tiled(q, k, v)
    o_te, lse_te = attention_tiled(q, k, v, softmax_scale=explicit)
    np.testing.assert_array_equal(o_t, o_te)
    np.testing.assert_array_equal(lse_t, lse_te)
    o_ref, _ = loop_reference(q, k, v, softmax_scale=explicit)
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-10)


def test_return_lse_flag():
    q, k, v = make_qkv(1, 5, 5, 2, 2, 32)
    o = attention_naive(q, k, v)
    assert isinstance(o, np.ndarray) and o.shape == q.shape
    assert o.dtype == np.float64


# ---------------------------------------------------------------------------
# input dtypes
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_low_precision_inputs_are_upcast(dtype):
    q, k, v = make_qkv(1, 13, 21, 4, 2, 64, dtype=dtype)
    o, lse = attention_naive(q, k, v, causal=True, return_lse=True)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    o_ref, lse_ref = loop_reference(q, k, v, causal=True)
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-10)
    assert_lse_close(lse, lse_ref)
    o_t, lse_t = attention_tiled(q, k, v, causal=True)
    np.testing.assert_allclose(o_t, o_ref, rtol=1e-10, atol=1e-10)


def test_bfloat16_inputs():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = make_qkv(1, 13, 21, 4, 2, 64, dtype=ml_dtypes.bfloat16)
    o, lse = attention_naive(q, k, v, causal=True, return_lse=True)
    o_ref, lse_ref = loop_reference(q.astype(np.float64), k.astype(np.float64),
                                    v.astype(np.float64), causal=True)
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-10)
    assert_lse_close(lse, lse_ref)
    o_t, _ = attention_tiled(q, k, v, causal=True)
    np.testing.assert_allclose(o_t, o_ref, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------
# lowp_attention
# ---------------------------------------------------------------------------

def rel_err(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(64, 64), (113, 203),
                                               (203, 113)])
def test_lowp_fp16_error_small(seqlen_q, seqlen_k, causal):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 64)
    with strict_fp():
        ref = attention_naive(q, k, v, causal=causal)
        low = lowp_attention(q, k, v, causal=causal, dtype=np.float16)
    assert low.dtype == np.float64 and low.shape == q.shape
    assert not np.isnan(low).any()
    err = rel_err(low, ref)
    assert 0 < err < 1e-2
    # Rounded to fp16 on the way out.
    np.testing.assert_array_equal(low, low.astype(np.float16))
    if causal and seqlen_q > seqlen_k:
        assert (low[:, :seqlen_q - seqlen_k] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_lowp_bf16_error_small(causal):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = make_qkv(2, 113, 203, 4, 2, 64)
    ref = attention_naive(q, k, v, causal=causal)
    low = lowp_attention(q, k, v, causal=causal, dtype=ml_dtypes.bfloat16)
    low_str = lowp_attention(q, k, v, causal=causal, dtype="bfloat16")
    np.testing.assert_array_equal(low, low_str)
    err_bf16 = rel_err(low, ref)
    err_fp16 = rel_err(lowp_attention(q, k, v, causal=causal), ref)
    # bf16 has 3 fewer mantissa bits than fp16, so it is coarser.
    assert 0 < err_fp16 < err_bf16 < 2e-2


def test_lowp_fully_masked_rows_are_zero():
    q, k, v = make_qkv(1, 10, 4, 2, 1, 32)
    with strict_fp():
        low = lowp_attention(q, k, v, causal=True)
    assert (low[:, :6] == 0).all()
    assert np.isfinite(low).all()


def test_lowp_explicit_scale():
    q, k, v = make_qkv(1, 31, 31, 2, 2, 64)
    ref = attention_naive(q, k, v, softmax_scale=0.05)
    low = lowp_attention(q, k, v, softmax_scale=0.05)
    assert 0 < rel_err(low, ref) < 1e-2


def test_lowp_rejects_other_dtypes():
    q, k, v = make_qkv(1, 4, 4, 1, 1, 8)
    with pytest.raises(ValueError, match="dtype"):
        lowp_attention(q, k, v, dtype=np.int32)


# ---------------------------------------------------------------------------
# input validation
# ---------------------------------------------------------------------------

def _bad_inputs():
    rng = np.random.default_rng()

    def r(*shape):
        return rng.standard_normal(shape)

    good_q, good_k, good_v = r(1, 8, 4, 16), r(1, 6, 2, 16), r(1, 6, 2, 16)
    return [
        pytest.param(r(8, 4, 16), good_k, good_v, r"\bq\b", id="q-ndim"),
        pytest.param(good_q, r(1, 6, 2, 16, 1), good_v, r"\bk\b",
                     id="k-ndim"),
        pytest.param(good_q, good_k, r(6, 2, 16), r"\bv\b", id="v-ndim"),
        pytest.param(good_q, good_k, r(1, 5, 2, 16), r"\bk\b.*\bv\b",
                     id="kv-shape"),
        pytest.param(good_q, r(2, 6, 2, 16), r(2, 6, 2, 16), "batch",
                     id="batch"),
        pytest.param(good_q, r(1, 6, 2, 32), r(1, 6, 2, 32), "headdim",
                     id="headdim"),
        pytest.param(good_q, r(1, 6, 3, 16), r(1, 6, 3, 16), "nheads_kv",
                     id="nheads-multiple"),
    ]


@pytest.mark.parametrize("fn", ["naive", "tiled", "lowp"])
@pytest.mark.parametrize("q,k,v,pattern", _bad_inputs())
def test_bad_input_raises(fn, q, k, v, pattern):
    func = {"naive": attention_naive, "tiled": attention_tiled,
            "lowp": lowp_attention}[fn]
    with pytest.raises(ValueError, match=pattern):
        func(q, k, v)


@pytest.mark.parametrize("kwargs,name", [
    ({"block_m": 0}, "block_m"),
    ({"block_n": -4}, "block_n"),
    ({"block_m": 2.5}, "block_m"),
])
def test_bad_block_sizes(kwargs, name):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16)
    with pytest.raises(ValueError, match=name):
        attention_tiled(q, k, v, **kwargs)


def test_bad_softmax_scale():
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16)
    with pytest.raises(ValueError, match="softmax_scale"):
        attention_naive(q, k, v, softmax_scale=float("nan"))


# ---------------------------------------------------------------------------
# non-finite inputs: "NaN in gives NaN out, in the affected rows"
# ---------------------------------------------------------------------------

NONFINITE = [pytest.param(np.nan, id="nan"), pytest.param(np.inf, id="inf"),
             pytest.param(-np.inf, id="-inf")]
# (seqlen_q, seqlen_k): equal, more keys, and more queries (the first
# seqlen_q - seqlen_k rows fully masked when causal).
NF_SEQLENS = [(12, 12), (9, 17), (19, 11)]


def forward(fn, q, k, v, causal):
    """(out, lse or None) of one of the forward functions, under strict_fp."""
    with strict_fp():
        if fn == "naive":
            return attention_naive(q, k, v, causal=causal, return_lse=True)
        if fn == "tiled":
            return attention_tiled(q, k, v, causal=causal, block_m=4,
                                   block_n=3)
        return lowp_attention(q, k, v, causal=causal), None


def visible(seqlen_q, seqlen_k, causal):
    return (causal_mask(seqlen_q, seqlen_k) if causal
            else np.ones((seqlen_q, seqlen_k), dtype=bool))


def assert_rows(got, clean, nan_rows, what):
    """``got`` is NaN on every element of the marked rows and equals ``clean``
    exactly elsewhere. got/clean: (..., D) arrays or (...) for the LSE;
    nan_rows: bool array of got.shape without the trailing D (if any)."""
    rows_nan = np.isnan(got) if got.ndim == nan_rows.ndim else np.isnan(got).all(-1)
    some_nan = np.isnan(got) if got.ndim == nan_rows.ndim else np.isnan(got).any(-1)
    np.testing.assert_array_equal(rows_nan, nan_rows, err_msg=f"{what}: NaN rows")
    np.testing.assert_array_equal(some_nan, nan_rows, err_msg=f"{what}: partial NaN rows")
    np.testing.assert_array_equal(got[~nan_rows], clean[~nan_rows], err_msg=what)


@pytest.mark.parametrize("fn", ["naive", "tiled", "lowp"])
@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", NF_SEQLENS)
def test_nonfinite_q_row(seqlen_q, seqlen_k, causal, value, fn):
    # One element of q row (b=1, i, h=2): that row of out and lse is NaN,
    # every other row is exactly the clean result.
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 16)
    out0, lse0 = forward(fn, q, k, v, causal)
    i = seqlen_q - 3                      # sees keys in every case here
    q[1, i, 2, 5] = value
    out, lse = forward(fn, q, k, v, causal)
    nan_out = np.zeros(out.shape[:-1], dtype=bool)     # (B, Sq, H)
    nan_out[1, i, 2] = True
    assert_rows(out, out0, nan_out, "out")
    if lse is not None:
        assert_rows(lse, lse0, np.moveaxis(nan_out, 1, 2), "lse")


@pytest.mark.parametrize("fn", ["naive", "tiled", "lowp"])
@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", NF_SEQLENS)
def test_nonfinite_kv_row(seqlen_q, seqlen_k, causal, which, value, fn):
    # One element of key/value row j of kv head 1 (GQA: query heads 2, 3
    # read it). Every query row of those heads that sees key j is NaN in out
    # (and in lse for k: the LSE does not read v); rows that do not see it
    # (causal: rows before it), other heads and the other batch are exact.
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 16)
    out0, lse0 = forward(fn, q, k, v, causal)
    j = seqlen_k - 3                      # causal: the last 3 rows see it
    {"k": k, "v": v}[which][0, j, 1, 7] = value
    out, lse = forward(fn, q, k, v, causal)

    sees_j = visible(seqlen_q, seqlen_k, causal)[:, j]     # (Sq,)
    if causal:
        assert not sees_j.all() and sees_j.any()
    nan_out = np.zeros(out.shape[:-1], dtype=bool)         # (B, Sq, H)
    nan_out[0, :, 2] = nan_out[0, :, 3] = sees_j
    assert_rows(out, out0, nan_out, "out")
    if lse is not None:
        nan_lse = np.moveaxis(nan_out, 1, 2) & (which == "k")
        assert_rows(lse, lse0, nan_lse, "lse")


@pytest.mark.parametrize("fn", ["naive", "tiled", "lowp"])
@pytest.mark.parametrize("value", NONFINITE)
def test_nonfinite_in_fully_masked_rows(fn, value):
    # A fully masked row reads nothing: a NaN / inf in its q row leaves it
    # out = 0, lse = +inf, with no warning (strict_fp in forward()). (Every
    # key is seen by the last row, so only q rows can be left unread.)
    seqlen_q, seqlen_k = 20, 6            # causal: rows 0..13 see no key
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 32)
    out0, lse0 = forward(fn, q, k, v, True)
    q[:, :14:3] = value
    out, lse = forward(fn, q, k, v, True)
    np.testing.assert_array_equal(out, out0)
    assert (out[:, :14] == 0).all()
    if lse is not None:
        np.testing.assert_array_equal(lse, lse0)
        assert np.isposinf(lse[:, :, :14]).all()


@pytest.mark.parametrize("fn", ["naive", "tiled", "lowp"])
def test_nonfinite_everywhere(fn):
    # Many non-finite values at once (random positions): the NaN rows are
    # those the rule gives, the rest exact; no warning on the way.
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(2, 23, 19, 6, 2, 8)
    out0, lse0 = forward(fn, q, k, v, True)
    for x in (q, k, v):
        idx = tuple(rng.integers(0, n, 3) for n in x.shape)
        x[idx] = rng.choice([np.nan, np.inf, -np.inf], 3)
    out, lse = forward(fn, q, k, v, True)
    vis = visible(23, 19, True)
    group = 3

    def bad(x):                           # (B, S, Hx) -> (B, H, S)
        return np.repeat(np.moveaxis(~np.isfinite(x).all(-1), 2, 1), group, 1)

    has = vis.any(1)
    lse_nan = has & (np.moveaxis(~np.isfinite(q).all(-1), 2, 1)
                     | (bad(k).astype(int) @ vis.T.astype(int) > 0))
    out_nan = lse_nan | (bad(v).astype(int) @ vis.T.astype(int) > 0)
    assert out_nan.any() and not out_nan.all()
    assert_rows(out, out0, np.moveaxis(out_nan, 1, 2), "out")
    if lse is not None:
        assert_rows(lse, lse0, lse_nan, "lse")


def test_lowp_input_overflowing_to_inf_is_nonfinite():
    # 1e6 is finite in float64 but +inf in float16: the fp16 baseline reads
    # an inf there (its row is NaN), the float64 oracle does not.
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16)
    base = lowp_attention(q, k, v)
    q[0, 3, 1, 0] = 1e6
    with strict_fp():
        low = lowp_attention(q, k, v)
        ref = attention_naive(q, k, v)
    assert np.isfinite(ref).all()
    nan_rows = np.zeros((1, 8, 2), dtype=bool)
    nan_rows[0, 3, 1] = True
    assert_rows(low, base, nan_rows, "lowp out")


# ---- against torch's scaled_dot_product_attention (math path, CPU) ----------

def torch_sdpa(q, k, v, causal):
    """torch math SDPA in float64 on (B, S, H, D) NumPy arrays, GQA by
    repeated kv heads; returns (out (B, Sq, H, D), lse (B, H, Sq)) with the
    LSE as the math path forms it (logsumexp of the scaled, masked scores)."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[2] // k.shape[2]
    tq, tk, tv = (torch.from_numpy(np.moveaxis(x, 2, 1).copy())
                  for x in (q, k, v))
    tk = tk.repeat_interleave(group, dim=1)
    tv = tv.repeat_interleave(group, dim=1)
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, is_causal=causal)
    s = tq @ tk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return np.moveaxis(out.numpy(), 1, 2), lse.numpy()


def nonfinite_rows(x):
    return ~np.isfinite(x).all(-1) if x.ndim == 4 else ~np.isfinite(x)


@pytest.mark.parametrize("value", NONFINITE)
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads,nheads_kv", [(4, 4), (4, 2), (4, 1)])
def test_nonfinite_matches_torch_sdpa(nheads, nheads_kv, causal, which,
                                      value):
    # Row by row, torch's math SDPA has a non-finite value in the same rows
    # as the reference's NaN rows, and equal values elsewhere. The
    # documented differences: torch gives +-inf or a NaN column where we give
    # a NaN row (same rows); a +-inf in k gives torch a finite row wherever
    # that key's score is -inf (we are NaN there: its rows are a subset of
    # ours); and with is_causal torch's masked entries leak a NaN key or
    # value (0 * NaN, NaN - inf) into the rows that do not see it, so the
    # causal cases use a key / value row seen by every query row (row 0).
    pytest.importorskip("torch")
    q, k, v = make_qkv(2, 16, 16, nheads, nheads_kv, 32)
    row = 0 if (causal and which != "q") else 5
    {"q": q, "k": k, "v": v}[which][1, row, 0, 3] = value
    with strict_fp():
        out, lse = attention_naive(q, k, v, causal=causal, return_lse=True)
    t_out, t_lse = torch_sdpa(q, k, v, causal)
    for name, ours, theirs in (("out", out, t_out), ("lse", lse, t_lse)):
        ours_nan = nonfinite_rows(ours)
        # Our non-finite rows are whole NaN rows.
        assert np.isnan(ours[ours_nan]).all(), name
        assert ours_nan.any() == (name == "out" or which != "v"), name
        theirs_bad = nonfinite_rows(theirs)
        if which == "k" and np.isinf(value):
            assert (theirs_bad <= ours_nan).all(), name
        else:
            np.testing.assert_array_equal(ours_nan, theirs_bad, err_msg=name)
        np.testing.assert_allclose(ours[~ours_nan], theirs[~ours_nan],
                                   rtol=1e-10, atol=1e-10, err_msg=name)
