"""Dropout's keep mask, the NumPy mirror of ``kernels_cu/philox.cuh``.

The kernels draw the mask from Philox4x32-7 (``PHILOX_ROUNDS``), keyed by the call's (seed, offset) and counted
by the element's (batch·nheads + head, query row, key column): the forward and the backward
regenerate the same mask without storing it, whatever their tiling. This module computes the
same mask on the host, bit for bit, for the tests and for ``return_attn_probs`` (S_dmask).

The definition (philox.cuh's header says it once more, next to the code): one call per
16 elements, those one thread of the mma accumulator layout holds in a 16-row x 32-column
block (rows ``g, g + 8``, columns ``8w + 2t, 8w + 2t + 1``, ``g = row % 8``, ``t = (col % 8) // 2``):

* key ``(seed_lo, seed_hi ^ offset_hi)``;
  counter ``(4 (col // 32) + (col % 8) // 2, 8 (row // 16) + row % 8, bh, offset_lo)``;
* element (row, col) is byte ``2 ((row % 16) // 8) + col % 2`` of output word ``(col % 32) // 8``;
* keep iff that byte ``>= round(p * 256)``: p is rounded to 1/256; kept values are scaled by
  ``1 / (1 - p)`` with the caller's p, as flash-attn does.
"""
from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LO = np.uint64(0xFFFFFFFF)


# Rounds of the mask's Philox (philox.cuh kPhiloxRounds): 7, the fewest that pass BigCrush
# (Salmon et al.); 10 until 0.2.0.dev0 (CHANGELOG: the masks of a given seed changed).
PHILOX_ROUNDS = 7


def philox4x32(c0, c1, c2, c3, k0: int, k1: int, rounds: int = PHILOX_ROUNDS) -> tuple:
    """Philox4x32-R on arrays of 32-bit counters (any broadcastable shapes), key (k0, k1)."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _LO for c in np.broadcast_arrays(c0, c1, c2, c3))
    k0, k1 = int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF
    for _ in range(rounds):
        p0, p1 = _M0 * c0, _M1 * c2                      # exact: < 2^64
        hi0, lo0, hi1, lo1 = p0 >> np.uint64(32), p0 & _LO, p1 >> np.uint64(32), p1 & _LO
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
        k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def drop_threshold(p: float) -> int:
    """Bytes below this are dropped: round(p · 256), as the kernels compute it in fp32."""
    return int(np.float32(p) * np.float32(256.0) + np.float32(0.5))


def keep_mask(seed: int, offset: int, p: float, batch: int, nheads: int, seqlen_q: int,
              seqlen_k: int, first_batch: int = 0) -> np.ndarray:
    """The kernels' keep mask, bool (batch, nheads, seqlen_q, seqlen_k), True = kept.
    first_batch: the batch index of the first batch entry (a varlen sequence b alone is
    batch=1, first_batch=b: its mask is that of batch index b, rows and columns counted from
    the sequence's start)."""
    seed, offset = int(seed) & (2 ** 64 - 1), int(offset) & (2 ** 64 - 1)
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) ^ (offset >> 32)
    rows, cols = np.arange(seqlen_q, dtype=np.int64), np.arange(seqlen_k, dtype=np.int64)
    # every call once: counter words c1 (rows) and c0 (columns) that the elements use
    c1 = np.arange(8 * -(-seqlen_q // 16), dtype=np.uint64)[None, :, None]
    c0 = np.arange(4 * -(-seqlen_k // 32), dtype=np.uint64)[None, None, :]
    bh = np.arange(first_batch * nheads, (first_batch + batch) * nheads, dtype=np.uint64)[:, None, None]
    words = philox4x32(c0, c1, bh, np.uint64(offset & 0xFFFFFFFF), k0, k1)
    raw = np.stack(words, axis=-1).astype("<u4").view(np.uint8).reshape(*words[0].shape, 16)
    # element (row, col): call (c1, c0), byte 4·word + b
    row_call = 8 * (rows // 16) + rows % 8
    col_call = 4 * (cols // 32) + (cols % 8) // 2
    byte = 4 * ((cols % 32) // 8)[None, :] + 2 * ((rows % 16) // 8)[:, None] + (cols % 2)[None, :]
    bytes_ = raw[:, row_call[:, None], col_call[None, :], byte]
    return (bytes_ >= drop_threshold(p)).reshape(batch, nheads, seqlen_q, seqlen_k)


def _words_to_f32(words: np.ndarray, dtype: str) -> np.ndarray:
    """16-bit words of bf16 or fp16 values as float32 (exact)."""
    words = np.ascontiguousarray(words).view(np.uint16)
    if dtype == "bf16":
        return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return words.view(np.float16).astype(np.float32)


def dropout_probs_host(q_words, k_words, lse, dtype: str, softmax_scale: float, causal: bool,
                       p: float, seed: int, offset: int, first_batch: int = 0, *,
                       window=(-1, -1), softcap: float = 0.0, alibi_slopes=None) -> np.ndarray:
    """S_dmask as flash-attn returns it (for testing): the attention probabilities
    P = exp(scale·q·kᵀ - lse), float32 (batch, nheads, seqlen_q, seqlen_k), with the entries
    that the kernels' keep mask (keep_mask) drops negated; causal-hidden entries, those outside
    the window and rows that see no key (lse = +inf) are 0. q_words, k_words: the (batch,
    seqlen, heads, headdim) inputs as their 16-bit words; lse: the forward's (batch, nheads,
    seqlen_q). window (left, right; -1 unbounded), softcap (0: off), alibi_slopes (fp32
    (nheads,) or (batch, nheads), or None): the call's, applied as the kernels do (softcap,
    then the ALiBi bias, then the masks)."""
    q = _words_to_f32(q_words, dtype).astype(np.float64)
    k = _words_to_f32(k_words, dtype).astype(np.float64)
    b, sq, h, _ = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    k = np.repeat(k, h // h_kv, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) * softmax_scale
    s = _score_features(s, sq, sk, causal, window, softcap, alibi_slopes, b, h, first_batch)
    lse = np.asarray(lse, np.float64)[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        probs = np.nan_to_num(np.exp(s - lse), nan=0.0).astype(np.float32)
    keep = keep_mask(seed, offset, p, b, h, sq, sk, first_batch)
    return np.where(keep, probs, -probs)


def _score_features(s, sq: int, sk: int, causal: bool, window, softcap: float, alibi_slopes,
                    batch: int, nheads: int, first_batch: int) -> np.ndarray:
    """The scaled scores s (batch, nheads, sq, sk), float64, softcapped, ALiBi-biased and masked
    (-inf) as the kernels do, with cuflash.reference's bias and window mask (bottom-right
    aligned). alibi_slopes (nheads,) or (B, nheads) with batch entries first_batch ..
    first_batch + batch (varlen: one sequence)."""
    from .reference import _alibi_bias, window_mask

    if softcap:
        s = softcap * np.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, np.float64)
        slopes = (np.broadcast_to(slopes, (batch, nheads)) if slopes.ndim == 1
                  else slopes[first_batch:first_batch + batch])
        s = s + _alibi_bias(slopes, sq, sk, 0, sq, 0, sk)
    return np.where(window_mask(sq, sk, tuple(int(w) for w in window), causal), s, -np.inf)


def varlen_dropout_probs_host(q_words, k_words, lse, cu_q, cu_k, max_q: int, max_k: int, dtype: str,
                              softmax_scale: float, causal: bool, p: float, seed: int,
                              offset: int, *, window=(-1, -1), softcap: float = 0.0,
                              alibi_slopes=None) -> np.ndarray:
    """S_dmask of a varlen call with dropout (for testing): float32 (batch, nheads, max_q, max_k),
    sequence b's dropout_probs_host (as the dense call of it alone at batch index b) in the
    top-left corner of entry b, zeros elsewhere. q_words (total_q, nheads, headdim), k_words
    (total_k, nheads_kv, headdim) 16-bit words; lse (nheads, total_q); cu_q, cu_k host ints;
    window, softcap, alibi_slopes as dropout_probs_host's (slopes (batch, nheads): row b for
    sequence b)."""
    cu_q, cu_k = np.asarray(cu_q, np.int64), np.asarray(cu_k, np.int64)
    nseq, h = len(cu_q) - 1, q_words.shape[1]
    out = np.zeros((nseq, h, max_q, max_k), np.float32)
    lse = np.asarray(lse, np.float32)
    for b in range(nseq):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        out[b, :, :q1 - q0, :k1 - k0] = dropout_probs_host(
            q_words[None, q0:q1], k_words[None, k0:k1], lse[None, :, q0:q1], dtype, softmax_scale,
            causal, p, seed, offset, first_batch=b, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes)[0]
    return out
