"""Decoding without a GPU: the split-KV (flash-decoding) partials and their LSE combine, the
KV-cache reference (append, rotary, paged KV, cache_batch_idx, leftpad, per-row lengths) and
flash_attn_with_kvcache (flash-attn 2.8's signature; torch CPU tensors run the reference and
update the caches in place; GPU-kind inputs raise UnsupportedFeature before any launch)."""
import inspect
import math

import numpy as np
import pytest

from cuflash import UnsupportedFeature, _gpu, reference
from cuflash.reference import (apply_rotary, attention_kvcache, attention_naive,
                               attention_splitkv_partials, combine_splits)

ATOL = 1e-12


def rand(rng, *shape):
    return rng.standard_normal(shape)


def assert_same_lse(a, b):
    assert np.array_equal(np.isposinf(a), np.isposinf(b))
    assert np.array_equal(np.isnan(a), np.isnan(b))
    fin = np.isfinite(a)
    np.testing.assert_allclose(a[fin], b[fin], rtol=0, atol=ATOL)


# ---------------------------------------------------------------------------------------
# split-KV partials + combine

def _random_features(rng, batch, nheads):
    kw = {}
    if rng.integers(2):
        kw["window_size"] = (int(rng.integers(-1, 4)), int(rng.integers(-1, 4)))
    if rng.integers(2):
        kw["softcap"] = float(rng.uniform(0.5, 3))
    if rng.integers(2):
        kw["alibi_slopes"] = rng.uniform(0, 1, (batch, nheads) if rng.integers(2) else (nheads,))
    return kw


@pytest.mark.parametrize("seed", range(40))
def test_partials_combine_equal_naive(seed):
    rng = np.random.default_rng(seed)
    batch, seqlen_q, seqlen_k = int(rng.integers(1, 3)), int(rng.integers(1, 7)), int(rng.integers(0, 11))
    nheads_kv = int(rng.integers(1, 3))
    nheads = nheads_kv * int(rng.integers(1, 4))             # GQA / MQA
    d = int(rng.integers(1, 9))
    q, k, v = (rand(rng, batch, s, h, d) for s, h in
               ((seqlen_q, nheads), (seqlen_k, nheads_kv), (seqlen_k, nheads_kv)))
    causal = bool(seed % 2)
    num_splits = int(rng.integers(1, 2 * seqlen_k + 3))      # often more splits than keys
    block_n = int(rng.integers(1, 4))
    kw = _random_features(rng, batch, nheads)
    out, lse = attention_naive(q, k, v, None, causal, True, **kw)
    out_p, lse_p = attention_splitkv_partials(q, k, v, num_splits, None, causal,
                                              block_n=block_n, **kw)
    assert out_p.shape == (num_splits, batch, seqlen_q, nheads, d)
    assert lse_p.shape == (num_splits, batch, nheads, seqlen_q)
    assert not np.isposinf(lse_p).any()
    out_c, lse_c = combine_splits(out_p, lse_p)
    np.testing.assert_allclose(out_c, out, rtol=0, atol=ATOL)
    assert_same_lse(lse_c, lse)


def test_partials_are_attention_over_their_chunk():
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, 2, 3, 4, 8), rand(rng, 2, 10, 2, 8), rand(rng, 2, 10, 2, 8)
    out_p, lse_p = attention_splitkv_partials(q, k, v, 3)          # chunks of ceil(10/3) = 4
    for s, (j0, j1) in enumerate([(0, 4), (4, 8), (8, 10)]):
        o, l = attention_naive(q, k[:, j0:j1], v[:, j0:j1], return_lse=True)
        np.testing.assert_allclose(out_p[s], o, atol=ATOL)
        np.testing.assert_allclose(lse_p[s], l, atol=ATOL)
    # more splits than keys: the extra splits are empty (O = 0, LSE = -inf)
    out_p, lse_p = attention_splitkv_partials(q, k[:, :2], v[:, :2], 5)
    assert np.isneginf(lse_p[2:]).all() and not out_p[2:].any()
    # block granularity: 10 keys in blocks of 4 -> 3 blocks, 2 splits of 2 blocks
    out_p, _ = attention_splitkv_partials(q, k, v, 2, block_n=4)
    np.testing.assert_allclose(out_p[1], attention_naive(q, k[:, 8:], v[:, 8:]), atol=ATOL)


def test_combine_fully_masked_and_empty_splits():
    rng = np.random.default_rng(2)
    q, k, v = rand(rng, 1, 5, 2, 4), rand(rng, 1, 2, 2, 4), rand(rng, 1, 2, 2, 4)
    # seqlen_q > seqlen_k, causal: the first rows see no key at all
    out_p, lse_p = attention_splitkv_partials(q, k, v, 4, causal=True)
    out, lse = combine_splits(out_p, lse_p)
    assert np.isposinf(lse[:, :, :3]).all() and not out[:, :3].any()
    ref_o, ref_l = attention_naive(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out, ref_o, atol=ATOL)
    assert_same_lse(lse, ref_l)
    # every split empty
    out, lse = combine_splits(np.full((3, 1, 2, 1, 4), np.nan), np.full((3, 1, 1, 2), -np.inf))
    assert not out.any() and np.isposinf(lse).all()


def test_combine_nan_rule_matches_naive():
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, 1, 4, 2, 4), rand(rng, 1, 9, 1, 4), rand(rng, 1, 9, 1, 4)
    k[0, 1, 0, 2] = np.nan
    v[0, 7, 0, 0] = np.inf
    for causal in (False, True):
        ref_o, ref_l = attention_naive(q, k, v, causal=causal, return_lse=True)
        out, lse = combine_splits(*attention_splitkv_partials(q, k, v, 3, causal=causal))
        assert np.array_equal(np.isnan(out), np.isnan(ref_o))
        assert np.array_equal(np.isnan(lse), np.isnan(ref_l))
        fin = ~np.isnan(ref_o)
        np.testing.assert_allclose(out[fin], ref_o[fin], atol=ATOL)


def test_combine_and_partials_validate():
    with pytest.raises(ValueError, match="out_partial must be a 5-D"):
        combine_splits(np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 4, 3)))
    with pytest.raises(ValueError, match=r"lse_partial must have shape"):
        combine_splits(np.zeros((2, 1, 3, 4, 5)), np.zeros((2, 1, 3, 4)))
    with pytest.raises(ValueError, match=r"lse_partial holds \+inf"):
        combine_splits(np.zeros((2, 1, 3, 4, 5)), np.full((2, 1, 4, 3), np.inf))
    q = np.zeros((1, 2, 2, 4))
    with pytest.raises(ValueError, match="num_splits must be a positive integer"):
        attention_splitkv_partials(q, q, q, 0)
    with pytest.raises(ValueError, match="block_n must be a positive integer"):
        attention_splitkv_partials(q, q, q, 2, block_n=0)


# ---------------------------------------------------------------------------------------
# the KV-cache reference

def _cache_problem(rng, batch=3, seqlen_q=2, cap=12, nheads=4, nheads_kv=2, d=8, new=2):
    q = rand(rng, batch, seqlen_q, nheads, d)
    kc, vc = rand(rng, batch, cap, nheads_kv, d), rand(rng, batch, cap, nheads_kv, d)
    kn = rand(rng, batch, new, nheads_kv, d) if new else None
    vn = rand(rng, batch, new, nheads_kv, d) if new else None
    return q, kc, vc, kn, vn


@pytest.mark.parametrize("seed", range(24))
def test_kvcache_equals_naive_on_each_rows_prefix(seed):
    rng = np.random.default_rng(100 + seed)
    new = int(rng.integers(0, 3))
    seqlen_q = int(rng.integers(1, 4))
    q, kc, vc, kn, vn = _cache_problem(rng, seqlen_q=seqlen_q, new=new)
    cap = kc.shape[1]
    lens = np.array([0, int(rng.integers(1, cap - new + 1)), cap - new])   # 0 included
    rng.shuffle(lens)
    causal = bool(seed % 2)
    kw = _random_features(rng, 3, 4)
    num_splits = int(rng.integers(0, 6))
    out, lse, k_new, v_new = attention_kvcache(q, kc, vc, lens, kn, vn, causal=causal,
                                               num_splits=num_splits, **kw)
    window = kw.pop("window_size", (-1, -1))
    for b in range(3):
        end = lens[b] + new
        kb = np.concatenate([kc[b, :lens[b]], kn[b]]) if new else kc[b, :end]
        vb = np.concatenate([vc[b, :lens[b]], vn[b]]) if new else vc[b, :end]
        alibi = kw.get("alibi_slopes")
        kwb = dict(kw, alibi_slopes=None if alibi is None else np.broadcast_to(alibi, (3, 4))[b])
        # flash-attn's normalization: one query row drops causal without ALiBi (no mask
        # then either way), a window bound >= the cache capacity is unbounded
        win = tuple(-1 if w >= cap else w for w in window)
        o, l = attention_naive(q[b:b + 1], kb[None], vb[None], None, causal, True,
                               window_size=win, **kwb)
        np.testing.assert_allclose(out[b:b + 1], o, atol=ATOL)
        assert_same_lse(lse[b:b + 1], l)
        np.testing.assert_array_equal(k_new[b, :end], kb)
        np.testing.assert_array_equal(v_new[b, :end], vb)
    zero = lens == 0
    if new == 0 and zero.any():
        b = int(np.argmax(zero))
        assert not out[b].any() and np.isposinf(lse[b]).all()


def test_kvcache_append_semantics():
    rng = np.random.default_rng(5)
    q, kc, vc, kn, vn = _cache_problem(rng, new=3)
    kc0, vc0 = kc.copy(), vc.copy()
    lens = np.array([0, 4, 9])
    _, _, k_new, v_new = attention_kvcache(q, kc, vc, lens, kn, vn)
    np.testing.assert_array_equal(kc, kc0)                      # inputs untouched
    np.testing.assert_array_equal(vc, vc0)
    for b, n in enumerate(lens):
        np.testing.assert_array_equal(k_new[b, n:n + 3], kn[b])
        np.testing.assert_array_equal(v_new[b, n:n + 3], vn[b])
        mask = np.ones(kc.shape[1], bool)
        mask[n:n + 3] = False
        np.testing.assert_array_equal(k_new[b, mask], kc[b, mask])   # the rest untouched
        np.testing.assert_array_equal(v_new[b, mask], vc[b, mask])
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        attention_kvcache(q, kc, vc, np.array([0, 4, 10]), kn, vn)   # 10 + 3 > 12
    with pytest.raises(ValueError, match="cache_seqlens must be given with k and v"):
        attention_kvcache(q, kc, vc, None, kn, vn)


def _paged(rng, kc, page, extra_blocks=2):
    """A paged copy of the contiguous cache kc: (pages, block_table)."""
    batch, cap = kc.shape[:2]
    nblk = cap // page
    total = batch * nblk + extra_blocks
    perm = rng.permutation(total)[:batch * nblk].reshape(batch, nblk)
    return perm.astype(np.int32), total


@pytest.mark.parametrize("page", [1, 3, 4, 12])
@pytest.mark.parametrize("new", [0, 2])
def test_paged_equals_contiguous(page, new):
    rng = np.random.default_rng(page * 10 + new)
    q, kc, vc, kn, vn = _cache_problem(rng, new=new)
    table, total = _paged(rng, kc, page)
    shape = (total, page) + kc.shape[2:]
    kp, vp = rand(rng, *shape), rand(rng, *shape)                # unused blocks: garbage
    for b in range(kc.shape[0]):
        for i, blk in enumerate(table[b]):
            kp[blk] = kc[b, i * page:(i + 1) * page]
            vp[blk] = vc[b, i * page:(i + 1) * page]
    lens = np.array([5, 0, 12 - new])
    kw = dict(causal=True, window_size=(6, -1), num_splits=3)
    out_c, lse_c, kc_new, vc_new = attention_kvcache(q, kc, vc, lens, kn, vn, **kw)
    out_p, lse_p, kp_new, vp_new = attention_kvcache(q, kp, vp, lens, kn, vn, block_table=table, **kw)
    np.testing.assert_allclose(out_p, out_c, atol=ATOL)
    assert_same_lse(lse_p, lse_c)
    for b in range(kc.shape[0]):
        gathered = np.concatenate([kp_new[blk] for blk in table[b]])
        np.testing.assert_array_equal(gathered, kc_new[b])
        np.testing.assert_array_equal(np.concatenate([vp_new[blk] for blk in table[b]]), vc_new[b])
    # table entries past a row's length are never read
    table2 = table.copy()
    for b, junk in enumerate((10 ** 6, -1, 7 * 10 ** 5)):
        table2[b, -(-(lens[b] + new) // page):] = junk
    out2 = attention_kvcache(q, kp, vp, lens, kn, vn, block_table=table2, **kw)[0]
    np.testing.assert_array_equal(out2, out_p)


def test_cache_batch_idx_and_leftpad():
    rng = np.random.default_rng(7)
    q, kc, vc, kn, vn = _cache_problem(rng, batch=2, new=1)
    big_k, big_v = rand(rng, 5, 12, 2, 8), rand(rng, 5, 12, 2, 8)
    idx = np.array([3, 1], np.int32)
    big_k[idx], big_v[idx] = kc, vc
    lens = np.array([4, 7])
    out_i, lse_i, bk_new, _ = attention_kvcache(q, big_k, big_v, lens, kn, vn, cache_batch_idx=idx,
                                                causal=True)
    out, lse, k_new, _ = attention_kvcache(q, kc, vc, lens, kn, vn, causal=True)
    np.testing.assert_allclose(out_i, out, atol=ATOL)
    np.testing.assert_array_equal(bk_new[idx], k_new)
    np.testing.assert_array_equal(bk_new[[0, 2, 4]], big_k[[0, 2, 4]])
    with pytest.raises(ValueError, match="read a cache slot that row 0 appends to"):
        attention_kvcache(q, big_k, big_v, lens, kn, vn, cache_batch_idx=np.array([1, 1]))
    with pytest.raises(ValueError, match="rows 0 and 1 append to the same cache slot"):
        attention_kvcache(q, big_k, big_v, np.array([4, 4]), kn, vn, cache_batch_idx=np.array([1, 1]))
    shared = np.array([[0, 1, 2], [0, 1, 3]])                  # a shared prefix page: read-only
    pk, pv = rand(rng, 4, 4, 2, 8), rand(rng, 4, 4, 2, 8)
    attention_kvcache(q, pk, pv, np.array([8, 9]), kn, vn, block_table=shared)
    with pytest.raises(ValueError, match="read a cache slot that row 0 appends to"):
        attention_kvcache(q, pk, pv, np.array([6, 8]), kn, vn, block_table=shared)
    with pytest.raises(ValueError, match="cache_batch_idx and block_table"):
        attention_kvcache(q, kc, vc, lens, cache_batch_idx=idx, block_table=np.zeros((2, 1), int))
    # leftpad: row b's keys are cache positions leftpad[b] .. cache_seqlens[b] + new - 1
    pad = np.array([2, 7])
    out_l, lse_l, _, _ = attention_kvcache(q, kc, vc, lens, kn, vn, cache_leftpad=pad, causal=True,
                                           alibi_slopes=np.array([0.3, 0.1, 0.2, 0.5]))
    for b in range(2):
        kb = np.concatenate([kc[b, pad[b]:lens[b]], kn[b]])
        vb = np.concatenate([vc[b, pad[b]:lens[b]], vn[b]])
        o, l = attention_naive(q[b:b + 1], kb[None], vb[None], causal=True, return_lse=True,
                               alibi_slopes=np.array([0.3, 0.1, 0.2, 0.5]))
        np.testing.assert_allclose(out_l[b:b + 1], o, atol=ATOL)
        assert_same_lse(lse_l[b:b + 1], l)
    with pytest.raises(ValueError, match="cache_leftpad must lie in"):
        attention_kvcache(q, kc, vc, lens, kn, vn, cache_leftpad=np.array([5, 0]))


def _rotate_direct(x, angle, interleaved):
    """x (..., d) rotated by angle (..., d_rot / 2), as complex numbers."""
    half = angle.shape[-1]
    out = x.copy()
    if interleaved:
        z = x[..., 0:2 * half:2] + 1j * x[..., 1:2 * half:2]
    else:
        z = x[..., :half] + 1j * x[..., half:2 * half]
    z = z * np.exp(1j * angle)
    if interleaved:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = z.real, z.imag
    else:
        out[..., :half], out[..., half:2 * half] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary_matches_the_direct_formula(interleaved, causal):
    rng = np.random.default_rng(11)
    q, kc, vc, kn, vn = _cache_problem(rng, batch=2, seqlen_q=3, new=3, d=8)
    angle = rng.uniform(0, 2 * math.pi, (16, 3))                  # rotary_dim 6 < headdim 8
    cos, sin = np.cos(angle), np.sin(angle)
    lens = np.array([2, 6])
    out, lse, k_new, _ = attention_kvcache(q, kc, vc, lens, kn, vn, rotary_cos=cos, rotary_sin=sin,
                                           rotary_interleaved=interleaved, causal=causal)
    for b in range(2):
        kpos = lens[b] + np.arange(3)
        k_rot = _rotate_direct(kn[b], angle[kpos][:, None, :], interleaved)
        np.testing.assert_allclose(k_new[b, lens[b]:lens[b] + 3], k_rot, atol=ATOL)
        qpos = lens[b] + (np.arange(3) if causal else np.zeros(3, int))
        q_rot = _rotate_direct(q[b], angle[qpos][:, None, :], interleaved)
        kb = np.concatenate([kc[b, :lens[b]], k_rot])
        vb = np.concatenate([vc[b, :lens[b]], vn[b]])
        o, l = attention_naive(q_rot[None], kb[None], vb[None], causal=causal, return_lse=True)
        np.testing.assert_allclose(out[b:b + 1], o, atol=ATOL)
        np.testing.assert_allclose(lse[b:b + 1], l, atol=ATOL)
    np.testing.assert_allclose(apply_rotary(kn, cos, sin, lens[:, None] + np.arange(3),
                                            interleaved)[1, 0],
                               _rotate_direct(kn[1, 0], angle[6][None], interleaved), atol=ATOL)
    with pytest.raises(ValueError, match="need k and v"):
        attention_kvcache(q, kc, vc, lens, rotary_cos=cos, rotary_sin=sin)
    with pytest.raises(ValueError, match="too short"):
        attention_kvcache(q, kc, vc, lens, kn, vn, rotary_cos=cos[:7], rotary_sin=sin[:7])


# ---------------------------------------------------------------------------------------
# flash_attn_with_kvcache

FLASH_ATTN_28_SIGNATURE = [
    ("q", inspect.Parameter.empty), ("k_cache", inspect.Parameter.empty),
    ("v_cache", inspect.Parameter.empty), ("k", None), ("v", None), ("rotary_cos", None),
    ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
    ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None), ("causal", False),
    ("window_size", (-1, -1)), ("softcap", 0.0), ("rotary_interleaved", True),
    ("alibi_slopes", None), ("num_splits", 0), ("return_softmax_lse", False)]


def test_signature_is_flash_attn_28s():
    import cuflash

    params = inspect.signature(cuflash.flash_attn_with_kvcache).parameters.values()
    assert [(p.name, p.default) for p in params] == FLASH_ATTN_28_SIGNATURE
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    assert cuflash.api.flash_attn_with_kvcache is cuflash.flash_attn_with_kvcache
    assert "flash_attn_with_kvcache" in cuflash.__all__


torch = None


def _torch():
    global torch
    torch = pytest.importorskip("torch")
    return torch


def t_problem(dtype=None, batch=3, seqlen_q=2, cap=12, nheads=4, nheads_kv=2, d=8, new=2, seed=0):
    th = _torch()
    dtype = dtype or th.float64
    g = th.Generator().manual_seed(seed)
    mk = lambda *s: th.randn(*s, generator=g, dtype=th.float64).to(dtype)  # noqa: E731
    q = mk(batch, seqlen_q, nheads, d)
    kc, vc = mk(batch, cap, nheads_kv, d), mk(batch, cap, nheads_kv, d)
    kn, vn = (mk(batch, new, nheads_kv, d), mk(batch, new, nheads_kv, d)) if new else (None, None)
    return q, kc, vc, kn, vn


@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_torch_cpu_runs_the_reference_and_updates_in_place(num_splits):
    th = _torch()
    from cuflash import flash_attn_with_kvcache

    q, kc, vc, kn, vn = t_problem()
    kc0, vc0 = kc.clone(), vc.clone()
    lens = th.tensor([0, 5, 10], dtype=th.int32)
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True,
                                       num_splits=num_splits, return_softmax_lse=True)
    ref_o, ref_l, ref_k, ref_v = attention_kvcache(q.numpy(), kc0.numpy(), vc0.numpy(),
                                                   lens.numpy(), kn.numpy(), vn.numpy(),
                                                   causal=True)
    assert out.dtype == th.float64 and lse.dtype == th.float32 and lse.shape == (3, 4, 2)
    np.testing.assert_allclose(out.numpy(), ref_o, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), ref_l.astype(np.float32), rtol=1e-6)
    np.testing.assert_array_equal(kc.numpy(), ref_k)          # in place
    np.testing.assert_array_equal(vc.numpy(), ref_v)
    # without return_softmax_lse: out alone; without k, v: the caches are only read
    kc1 = kc.clone()
    out2 = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens + 2, causal=True)
    assert isinstance(out2, th.Tensor)
    np.testing.assert_allclose(out2.numpy(), out.numpy(), atol=1e-12)
    assert th.equal(kc, kc1)
    # an int cache_seqlens, and the default (the whole cache)
    o_int = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=12)
    o_all = flash_attn_with_kvcache(q, kc, vc)
    assert th.equal(o_int, o_all)


def test_torch_cpu_paged_rotary_bf16():
    th = _torch()
    from cuflash import flash_attn_with_kvcache

    q, kc, vc, kn, vn = t_problem(th.bfloat16, batch=2, cap=8, d=16, new=1, seqlen_q=1)
    page = 4
    table = th.tensor([[3, 0], [1, 2]], dtype=th.int32)
    kp, vp = th.zeros(4, page, 2, 16, dtype=th.bfloat16), th.zeros(4, page, 2, 16, dtype=th.bfloat16)
    for b in range(2):
        for i in range(2):
            kp[table[b, i]] = kc[b, i * page:(i + 1) * page]
            vp[table[b, i]] = vc[b, i * page:(i + 1) * page]
    angle = th.rand(8, 8, dtype=th.float64) * 2 * math.pi
    cos, sin = angle.cos().to(th.bfloat16), angle.sin().to(th.bfloat16)
    lens = th.tensor([3, 7], dtype=th.int32)
    args = dict(cache_seqlens=lens, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False,
                return_softmax_lse=True)
    out_c, lse_c = flash_attn_with_kvcache(q, kc, vc, kn, vn, **args)
    out_p, lse_p = flash_attn_with_kvcache(q, kp, vp, kn, vn, block_table=table, **args)
    assert out_c.dtype == th.bfloat16
    assert th.equal(out_c, out_p) and th.equal(lse_c, lse_p)
    for b in range(2):   # the rotated new key is in the cache, rounded to bf16
        n = int(lens[b])
        c, s_ = cos.double().numpy()[n], sin.double().numpy()[n]
        x = kn[b, 0].double().numpy()
        a, bb = x[..., :8], x[..., 8:]
        want = th.from_numpy(np.concatenate([a * c - bb * s_, a * s_ + bb * c], -1)).to(th.bfloat16)
        assert th.equal(kc[b, n], want)
        assert th.equal(th.cat([kp[table[b, 0]], kp[table[b, 1]]])[n], want)


BAD_ARGS = [
    (dict(q="q"), TypeError, r"^q: expected a CuPy array, NumPy array or torch tensor"),
    (dict(k_cache=lambda a: a["k_cache"][..., :4]), ValueError, r"^k_cache: headdim must match"),
    (dict(v_cache=lambda a: a["v_cache"][:, :5]), ValueError, r"^v_cache: shape must equal"),
    (dict(k_cache=lambda a: a["k_cache"].float()), TypeError, r"^k_cache: dtype must be q's"),
    (dict(q=lambda a: a["q"][:, :, :3]), ValueError, r"^k_cache: nheads_kv=2 must divide"),
    (dict(k=None), ValueError, r"^k: k and v must be given together"),
    (dict(v=lambda a: a["v"][:, :1]), ValueError, r"^v: shape must equal k's"),
    (dict(k=lambda a: a["k"][:, :, :1], v=lambda a: a["v"][:, :, :1]), ValueError,
     r"^k: expected shape \(batch, seqlen_new, nheads_kv, headdim\)"),
    (dict(cache_seqlens=None), ValueError, r"^cache_seqlens: must be given with k and v"),
    (dict(cache_seqlens=lambda a: a["cache_seqlens"].long()), TypeError,
     r"^cache_seqlens: dtype must be int32"),
    (dict(cache_seqlens=lambda a: a["cache_seqlens"][:2]), ValueError,
     r"^cache_seqlens: expected shape \(batch,\)"),
    (dict(cache_seqlens=11), ValueError, r"^cache_seqlens: must lie in \[0, 10\]"),
    (dict(cache_seqlens=2.0), TypeError, r"^cache_seqlens must be an int"),
    (dict(cache_batch_idx=lambda a: a["cache_seqlens"] * 0 + 5), ValueError,
     r"^cache_batch_idx: must index k_cache's 3 rows"),
    (dict(cache_batch_idx=lambda a: a["cache_seqlens"] * 0), ValueError,
     r"^cache_batch_idx: repeats a cache row"),
    (dict(cache_leftpad=lambda a: a["cache_seqlens"] + 1), ValueError,
     r"^cache_leftpad: must lie in"),
    (dict(block_table=lambda a: a["cache_seqlens"][:, None] * 0, cache_batch_idx=lambda a:
          a["cache_seqlens"] * 0), ValueError, r"^cache_batch_idx: can't be used with block_table"),
    (dict(block_table=lambda a: a["cache_seqlens"].long()[:, None]), TypeError,
     r"^block_table: dtype must be int32"),
    (dict(block_table=lambda a: (a["cache_seqlens"] * 0 + 9)[:, None].repeat(1, 1)), ValueError,
     r"^block_table: the entries in use must index"),
    (dict(rotary_cos=lambda a: a["rot"]), ValueError, r"^rotary_sin: rotary_cos and rotary_sin "
                                                       r"must be given together"),
    (dict(rotary_cos=lambda a: a["rot"], rotary_sin=lambda a: a["rot"][:4]), ValueError,
     r"^rotary_sin: shape must equal"),
    (dict(rotary_cos=lambda a: a["rot"][:4], rotary_sin=lambda a: a["rot"][:4]), ValueError,
     r"^rotary_cos: seqlen_ro = 4 rows must cover"),
    (dict(rotary_cos=lambda a: a["rot"].float(), rotary_sin=lambda a: a["rot"].float()), TypeError,
     r"^rotary_cos: dtype must be q's"),
    (dict(rotary_cos=lambda a: a["rot"].repeat(1, 3), rotary_sin=lambda a: a["rot"].repeat(1, 3)),
     ValueError, r"^rotary_cos: rotary_dim = 2 \* rotary_cos.shape\[1\] = 12 must be in"),
    (dict(rotary_cos=lambda a: a["rot"], rotary_sin=lambda a: a["rot"], k=None, v=None),
     ValueError, r"^rotary_cos: rotary embedding needs the new k and v"),
    (dict(softmax_scale="x"), TypeError, r"^softmax_scale must be a real number"),
    (dict(softmax_scale=-1.0), ValueError, r"^softmax_scale must be a finite number > 0"),
    (dict(causal="yes"), TypeError, r"^causal must be a bool"),
    (dict(window_size=(1,)), TypeError, r"^window_size must be a pair"),
    (dict(window_size=(-2, 0)), ValueError, r"^window_size must be >= -1"),
    (dict(softcap=-1.0), ValueError, r"^softcap must be a finite number >= 0"),
    (dict(rotary_interleaved="no"), TypeError, r"^rotary_interleaved must be a bool"),
    (dict(alibi_slopes=lambda a: a["q"][0, 0, :, 0]), TypeError,
     r"^alibi_slopes: dtype must be float32"),
    (dict(alibi_slopes=lambda a: a["q"][0, 0, :3, 0].float()), ValueError,
     r"^alibi_slopes: expected shape \(nheads,\)"),
    (dict(num_splits=-1), ValueError, r"^num_splits must be in \[0, 128\]"),
    (dict(num_splits=129), ValueError, r"^num_splits must be in \[0, 128\]"),
    (dict(num_splits=2.0), TypeError, r"^num_splits must be an int"),
    (dict(num_splits=True), TypeError, r"^num_splits must be an int"),
]


@pytest.mark.parametrize("change,exc,pattern", BAD_ARGS, ids=[str(i) for i in range(len(BAD_ARGS))])
def test_bad_arguments_name_the_argument(change, exc, pattern):
    th = _torch()
    from cuflash import flash_attn_with_kvcache

    q, kc, vc, kn, vn = t_problem()
    args = dict(q=q, k_cache=kc, v_cache=vc, k=kn, v=vn,
                cache_seqlens=th.tensor([0, 3, 10], dtype=th.int32))
    extra = dict(rot=th.ones(12, 2, dtype=th.float64))
    kc0 = kc.clone()
    for name, val in change.items():
        args[name] = val(dict(args, **extra)) if callable(val) else val
    with pytest.raises(exc, match=pattern):
        flash_attn_with_kvcache(**args)
    assert th.equal(kc, kc0)                                   # nothing written


def _numpy_call(**changes):
    rng = np.random.default_rng(0)
    q, kc, vc, kn, vn = (x.astype(np.float16) for x in _cache_problem(rng))
    args = dict(q=q, k_cache=kc, v_cache=vc, k=kn, v=vn,
                cache_seqlens=np.array([0, 3, 10], np.int32))
    args.update(changes)
    return args


@pytest.mark.parametrize("changes", [
    {}, dict(k=None, v=None), dict(num_splits=4, causal=True),
    dict(block_table=np.zeros((3, 2), np.int32), k_cache=np.zeros((4, 6, 2, 8), np.float16),
         v_cache=np.zeros((4, 6, 2, 8), np.float16)),
    dict(alibi_slopes=np.ones(4, np.float32), softcap=1.0, window_size=(3, 0))])
def test_numpy_inputs_reach_the_gpu_after_validation(changes, monkeypatch):
    """NumPy inputs run through the GPU (tests/test_kvcache_numpy_cpu.py fakes one): without
    one, the error comes after validation and leaves the cache untouched."""
    from cuflash import flash_attn_with_kvcache

    def require(what):
        raise _gpu.NoGPUError(f"{what} needs a CUDA GPU")

    monkeypatch.setattr(_gpu, "require", require)
    args = _numpy_call(**changes)
    kc0 = args["k_cache"].copy()
    with pytest.raises(_gpu.NoGPUError, match=r"^flash_attn_with_kvcache \(NumPy inputs\) needs"):
        flash_attn_with_kvcache(**args)
    np.testing.assert_array_equal(args["k_cache"], kc0)


def test_gpu_kind_inputs_are_validated_first(monkeypatch):
    from cuflash import flash_attn_with_kvcache

    monkeypatch.setattr(_gpu, "require", lambda what: pytest.fail("reached the GPU"))
    with pytest.raises(TypeError, match=r"^cache_seqlens: dtype must be int32"):
        flash_attn_with_kvcache(**_numpy_call(cache_seqlens=np.array([0, 3, 10])))
    with pytest.raises(ValueError, match=r"^k_cache: the last dimension \(headdim\) must be "
                                         r"contiguous"):
        kc = np.zeros((3, 12, 2, 16), np.float16)[..., ::2]
        flash_attn_with_kvcache(**_numpy_call(k_cache=kc, v_cache=kc))
    with pytest.raises(TypeError, match=r"^k_cache: expected a numpy array like q"):
        _torch()
        args = _numpy_call()
        args["k_cache"] = torch.zeros(3, 12, 2, 8, dtype=torch.float16)
        flash_attn_with_kvcache(**args)


def test_decode_problem_for_a_family():
    """What a decode family will be asked: op 'decode', seqlen_k = the cache capacity, the
    call's features by name."""
    from cuflash.decode import check_kvcache

    args = _numpy_call(block_table=np.zeros((3, 2), np.int32),
                       k_cache=np.zeros((4, 6, 2, 8), np.float16),
                       v_cache=np.zeros((4, 6, 2, 8), np.float16), softcap=2.0, causal=True)
    call = check_kvcache(**args)
    p = call.problem("fp16")
    assert (p.op, p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads_kv, p.head_dim) == \
        ("decode", 3, 2, 12, 4, 2, 8)
    assert p.causal and p.features == ("append", "paged_kv", "softcap")
    assert call.window_size == (-1, 0) and call.seqlen_new == 2
    # one query row drops causal (flash-attn: no mask then either way), unless ALiBi
    one = check_kvcache(**_numpy_call(q=args["q"][:, :1], causal=True))
    assert not one.causal and one.window_size == (-1, -1)


def test_reference_exported():
    for name in ("attention_splitkv_partials", "combine_splits", "apply_rotary",
                 "attention_kvcache"):
        assert name in reference.__all__ and callable(getattr(reference, name))


# ---------------------------------------------------------------------------------------
# the decode_splitkv family without a GPU: configs, split rule, launch plan and params

def test_decode_family_registered_and_configs(monkeypatch):
    from cuflash import registry
    from cuflash.families import decode_splitkv as mod
    from cuflash.families.decode_splitkv import DecodeConfig, ctas_per_sm, num_splits_for
    from cuflash.problem import Problem

    monkeypatch.setattr(mod, "TMA_DEFAULT", False)  # the cp.async loop (tests/test_decode_tma_cpu.py: the other)

    fam = registry.get("decode_splitkv")
    assert fam.op == "decode" and fam in registry.families("decode")
    p = Problem("decode", "bf16", 1, 1, 131072, 32, 8, 128)
    cfg = fam.heuristic(p)
    assert not cfg.problems(227 * 1024) and cfg.m_tiles == 1
    assert cfg.kernel_name().startswith("cuflash::decode_splitkv<")
    # splits from shapes only (the H100's 132 SMs, 227 KB): one whole wave of CTAs, never a
    # partial one (batch 8 x 8 KV heads: 2 splits, not 3)
    assert cfg.warps == 8 and cfg.stages == 3 and ctas_per_sm(cfg, 227 * 1024) == 1
    assert num_splits_for(cfg, p, 132) == 16
    assert num_splits_for(cfg, p.replace(batch=8, seqlen_k=32768), 132) == 2
    assert num_splits_for(cfg, p.replace(batch=32, seqlen_k=8192), 132) == 1
    assert num_splits_for(cfg, p.replace(batch=64), 132) == 1
    small = cfg.replace(warps=4)  # two CTAs per SM: twice the slots
    assert ctas_per_sm(small, 227 * 1024) == 2 and num_splits_for(small, p, 132) == 33
    assert num_splits_for(cfg, p.replace(seqlen_k=64), 132) == 1      # one block: no split
    assert 1 <= num_splits_for(cfg, p.replace(seqlen_k=1), 132) <= 128
    # speculative decoding: 4 query rows x group 4 = 16 rows fit one tile, 32 need two
    assert fam.heuristic(p.replace(seqlen_q=8)).m_tiles == 2
    bad = DecodeConfig(4, 24, 1, 3, -1, 128, "bf16", False, 300)
    why = " ".join(bad.problems())
    for rule in ("warp_n", "stages", "m_tiles", "split_cost", "splits"):
        assert rule in why
    assert fam.decode(fam.encode(cfg), "bf16", False) == cfg


def test_decode_plan_launches_and_params(monkeypatch):
    """A paged, appending, rotary, GQA call through launch.Plan with fake kernels: the grid of
    each role, the workspace pieces and every params field the kernels read."""
    from types import SimpleNamespace

    from cuflash import launch, registry
    from cuflash.families import decode_splitkv as mod
    from cuflash.problem import Problem

    monkeypatch.setattr(mod, "TMA_DEFAULT", False)  # the cp.async loop's plan (no tensor maps)
    monkeypatch.setattr(mod, "FUSED_COMBINE_DEFAULT", False)  # the separate combine launch
    calls = []

    def record(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        calls.append(dict(fn=fn, grid=(gx, gy, gz), threads=bx, smem=smem))

    fam = registry.get("decode_splitkv")
    monkeypatch.setattr(launch, "get_kernels", lambda config, device: {
        role: SimpleNamespace(kernel=SimpleNamespace(ptr=1000 + i))
        for i, role in enumerate(fam.kernel_names(config))})
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(launch, "_driver_launch", lambda: record)
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda device: None))
    p = Problem("decode", "bf16", 2, 3, 4096, 16, 4, 128, True, False,
                ("append", "paged_kv", "rotary"))
    cfg = fam.heuristic(p).replace(splits=5)
    strides = {"q": (3 * 16 * 128, 16 * 128, 128), "k_cache": (256 * 4 * 128, 4 * 128, 128),
               "v_cache": (256 * 4 * 128, 4 * 128, 128), "k_new": (3 * 4 * 128, 4 * 128, 128),
               "v_new": (3 * 4 * 128, 4 * 128, 128), "o": (3 * 16 * 128, 16 * 128, 128),
               "call": dict(seqlen_new=3, page_size=256, num_pages=40, rotary_dim=64,
                            rotary_row_stride=32, rotary_q_per_row=True, block_table_stride=16,
                            window=(-1, 0), cache_seqlen_fixed=4096)}
    plan = launch.Plan(fam, cfg, p, strides, 0.125, 0)
    ws = fam.workspace(cfg, p)
    rows = 2 * 16 * 3
    assert ws["o_partial"] == 0 and ws["lse_partial"] >= 5 * rows * 128 * 4
    assert ws["q_rot"] >= ws["lse_partial"] + 5 * rows * 4 and plan.workspace_bytes == ws["total"]
    names = list(fam.kernel_names(cfg))
    plan.run(tuple(range(0x1000, 0x1000 + 14 * 0x100, 0x100)), 0x900000, 0)
    assert [c["fn"] - 1000 for c in calls] == [names.index(r) for r in ("append", "main", "combine")]
    assert calls[0]["grid"] == (32, 2, 1)
    assert calls[1]["grid"] == (5, 4 * 1, 2) and calls[1]["smem"] == cfg.smem_bytes  # 12 rows: 1 tile
    assert calls[2]["grid"] == (-(-rows // 4), 1, 1)
    rec = plan._record[0]
    assert (rec["num_splits"], rec["group"], rec["row_blocks"], rec["page_size"]) == (5, 4, 1, 256)
    assert (rec["window_left"], rec["window_right"], rec["seqlen_new"]) == (-1, 0, 3)
    assert (rec["capacity"], rec["num_pages"], rec["head_dim_rounded"]) == (4096, 40, 128)
    assert int(rec["o_partial"]) == 0x900000 and int(rec["q_rot"]) == 0x900000 + ws["q_rot"]
    # no split: no combine, no partials
    one = launch.Plan(fam, cfg.replace(splits=1), p.replace(features=()), strides, 0.125, 0)
    assert [s.role for s in one.launches] == ["main"] and one.workspace_bytes == 0


def test_kvcache_torch_op_on_cpu_mutates_the_cache():
    """cuflash::kvcache (what torch.compile traces) equals the eager call and appends in place."""
    th = _torch()
    from cuflash import flash_attn_with_kvcache, torch_ops  # noqa: F401 - defines the op

    q, kc, vc, kn, vn = t_problem(th.float32)
    lens = th.tensor([0, 3, 10], dtype=th.int32)
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True,
                                       return_softmax_lse=True)
    out2, lse2 = th.ops.cuflash.kvcache(q, kc2, vc2, kn, vn, None, None, lens, None, None, None,
                                        None, -1, 1 / math.sqrt(q.shape[-1]), True, -1, -1, 0.0,
                                        True, 0)
    assert th.equal(out, out2) and th.equal(lse, lse2)
    assert th.equal(kc, kc2) and th.equal(vc, vc2) and not th.equal(kc2, t_problem(th.float32)[1])
    # an int cache_seqlens goes through the op's int argument
    out3 = torch_ops.kvcache_traced(q, kc2.clone(), vc2.clone(), None, None, None, None, 4, None,
                                    None, None, None, False, (-1, -1), 0.0, True, None, 0)[0]
    want = flash_attn_with_kvcache(q, kc2.clone(), vc2.clone(), cache_seqlens=4)
    assert th.equal(out3, want)


@pytest.mark.parametrize("seed", range(40))
def test_kernel_index_math_mirror_equals_reference(seed):
    """decode_splitkv.cu's splits, ranges, masks, warp merge and combine (tests/decode_mirror.py,
    a line-by-line NumPy mirror) give the reference's answer on random calls."""
    from decode_mirror import kernel_mirror

    rng = np.random.default_rng(seed)
    batch, sq = int(rng.integers(1, 4)), int(rng.integers(1, 6))
    hk, group = int(rng.integers(1, 3)), int(rng.choice([1, 2, 4, 8]))
    h, d, new = hk * group, 8, int(rng.integers(0, 3))
    cap = max(int(rng.integers(1, 300)), new)
    ends = rng.integers(0, cap - new + 1, batch)
    starts = (np.array([rng.integers(0, e + 1) for e in ends]) if rng.integers(2)
              else np.zeros(batch, np.int64))
    q = rand(rng, batch, sq, h, d)
    kc, vc = rand(rng, batch, cap, hk, d), rand(rng, batch, cap, hk, d)
    kn, vn = (rand(rng, batch, new, hk, d), rand(rng, batch, new, hk, d)) if new else (None, None)
    causal = bool(rng.integers(2))
    window = (int(rng.integers(-1, 20)), int(rng.integers(-1, 5))) if rng.integers(2) else (-1, -1)
    softcap = float(rng.uniform(0.5, 3)) if rng.integers(2) else 0.0
    slopes = rng.uniform(0, 1, (batch, h)) if rng.integers(2) else None
    splits = int(rng.integers(1, 6))
    warps, warp_n, m_tiles = int(rng.choice([1, 2, 4])), int(rng.choice([16, 32])), int(rng.choice([1, 2]))
    out_ref, lse_ref, k_new, v_new = attention_kvcache(
        q, kc, vc, ends, kn, vn, cache_leftpad=starts, causal=causal, window_size=window,
        softcap=softcap, alibi_slopes=slopes)
    _, win = reference._normalize_kvcache_window(window, causal, sq, cap, slopes is not None)
    out, lse = kernel_mirror(q, k_new, v_new, ends, starts, new, 1 / math.sqrt(d), win, softcap,
                             slopes, splits, warps, warp_n, m_tiles)
    np.testing.assert_allclose(out, out_ref, rtol=0, atol=1e-9)
    assert_same_lse(lse, lse_ref)


def test_gpu_entry_passes_tensor_subclasses_by_address(monkeypatch):
    """An nn.Parameter (a torch.Tensor subclass) is a tensor: the launch gets its address (not
    0) and a dense copy when it is strided, and it keys the plan cache by layout, not identity."""
    torch = pytest.importorskip("torch")
    from cuflash import decode

    launched = []

    class Plan:
        def run(self, ptrs, ws, stream):
            launched.append(ptrs)

    entry = decode._GpuEntry()
    entry.plan, entry.out_shape, entry.lse_shape = Plan(), (1, 1, 2, 8), (1, 2, 1)
    entry.ws_bytes, entry.empty, entry.device, entry.contiguous = 0, False, None, (5,)
    entry.raw_stream = lambda device: 0
    entry.f32, entry.u8 = torch.float32, torch.uint8
    q = torch.zeros(1, 1, 2, 8, dtype=torch.float16)
    cos = torch.nn.Parameter(torch.zeros(8, 4).t(), requires_grad=False)   # strided
    seqlens = torch.nn.Parameter(torch.zeros(1, dtype=torch.int32), requires_grad=False)
    args = (q, q, q, None, None, cos, None, seqlens, None, None, None, None)
    entry.slots = tuple(i for i, x in enumerate(args) if isinstance(x, torch.Tensor))
    entry.run(args)
    ptrs = launched[0]
    assert ptrs[7] == seqlens.data_ptr() and ptrs[5] not in (0, cos.data_ptr())
    key = decode._gpu_key(args, None, False, (-1, -1), 0.0, True, 0)
    seqlens2 = torch.nn.Parameter(torch.ones(1, dtype=torch.int32), requires_grad=False)
    cos2 = torch.nn.Parameter(torch.ones(8, 4).t(), requires_grad=False)
    assert key == decode._gpu_key(args[:5] + (cos2, None, seqlens2) + args[8:], None, False,
                                  (-1, -1), 0.0, True, 0)



@pytest.mark.parametrize("valid,invalid", [
    (dict(num_splits=0), dict(num_splits=False)), (dict(num_splits=1), dict(num_splits=1.0)),
    (dict(softcap=0.0), dict(softcap=False)), (dict(softmax_scale=1.0), dict(softmax_scale=True)),
    (dict(window_size=(-1, -1)), dict(window_size=(-1.0, -1))),
    (dict(window_size=(1, 0)), dict(window_size=(True, 0))),
], ids=lambda kw: "-".join(f"{k}={v!r}" for k, v in kw.items()))
def test_gpu_key_tells_apart_what_validation_does(valid, invalid):
    """True == 1 == 1.0 and (-1.0, -1) == (-1, -1) hash alike: keyed by value alone, a call that
    validation rejects (a bool or float num_splits, a bool softcap or scale, a float window
    bound) found the plan of an earlier valid call and ran unvalidated (the CuPy key too)."""
    torch = pytest.importorskip("torch")
    from cuflash import decode

    q = torch.zeros(1, 1, 2, 16, dtype=torch.float16)
    args = (q, q, q) + (None,) * 9
    base = dict(softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                rotary_interleaved=True, num_splits=0)
    names = list(base)
    good, bad = dict(base, **valid), dict(base, **invalid)
    decode.check_kvcache(q, q, q, **good)
    with pytest.raises(TypeError):
        decode.check_kvcache(q, q, q, **bad)
    for array_class in (None, torch.Tensor):  # the torch key, and the CuPy one's shape
        keys = [decode._gpu_key(args, *(kw[n] for n in names), array_class=array_class)
                if array_class is None else
                decode._gpu_key((None,) * 12, *(kw[n] for n in names), array_class=array_class)
                for kw in (good, bad)]
        assert keys[0] != keys[1]
    # the flags take bools and ints alike: one plan for both
    assert decode._gpu_key(args, None, True, (-1, -1), 0.0, 1, 0)[-10:] == \
        decode._gpu_key(args, None, 1, (-1, -1), 0.0, True, 0)[-10:]

def test_kvcache_traced_checks_its_scalars_as_eager_does():
    """The torch.compile route must not coerce what eager validation rejects: a negative int
    cache_seqlens became the op's -1 ("no int": the whole cache), int() truncated a float
    window, bool() took any causal."""
    th = _torch()
    from cuflash import torch_ops

    q, kc, vc, _, _ = t_problem(th.float32)

    def call(cache_seqlens=4, causal=False, window=(-1, -1), softcap=0.0, num_splits=0):
        return torch_ops.kvcache_traced(q, kc.clone(), vc.clone(), None, None, None, None,
                                        cache_seqlens, None, None, None, None, causal, window,
                                        softcap, True, None, num_splits)

    call()
    for kw, exc, pattern in (({"cache_seqlens": -1}, ValueError, r"^cache_seqlens"),
                             ({"window": (2.5, 0)}, TypeError, r"^window_size"),
                             ({"causal": "yes"}, TypeError, r"^causal"),
                             ({"num_splits": 2.0}, TypeError, r"^num_splits"),
                             ({"softcap": "big"}, TypeError, r"^softcap")):
        with pytest.raises(exc, match=pattern):
            call(**kw)
