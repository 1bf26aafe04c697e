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
