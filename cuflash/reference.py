"""NumPy float64 reference implementations of exact attention (the test oracle).

Every GPU kernel in cuflash is checked against the functions in this module.

Conventions (shared with the kernels):

* Layout: ``q`` is ``(batch, seqlen_q, nheads, headdim)``; ``k`` and ``v`` are
  ``(batch, seqlen_k, nheads_kv, headdim)``. The output ``O`` has ``q``'s shape.
* GQA / MQA: ``nheads % nheads_kv == 0`` and query head ``h`` reads kv head
  ``h // (nheads // nheads_kv)``.
* ``softmax_scale`` defaults to ``1 / sqrt(headdim)``.
* LSE has shape ``(batch, nheads, seqlen_q)``, is float64 and uses the natural
  log: ``lse[b, h, i] = log(sum_j exp(scale * q[b, i, h] . k[b, j, h_kv]))``
  over the keys row ``i`` may attend.
* Causal masking is aligned to the bottom-right corner of the score matrix
  (the flash-attn >= 2.1 convention): query row ``i`` may attend key ``j`` iff
  ``j <= i + (seqlen_k - seqlen_q)``. With ``seqlen_q > seqlen_k`` the first
  rows can have no key at all.
* A fully masked row (no key allowed) yields an output row of zeros and
  ``lse = +inf``, so that a backward pass recomputing ``exp(S - lse)`` gets 0.
  No NaN is produced and no floating point warning is raised on the way.
* Backward: ``dq`` has ``q``'s shape, ``dk`` and ``dv`` have ``k``'s shape.
  With GQA / MQA the gradient of a kv head is the sum over the query heads
  that read it. Fully masked rows contribute nothing to any gradient.

Features (flash-attn 2.8's definitions; keyword-only arguments of every
function, forward and backward; float64 throughout):

* ``window_size=(left, right)``, -1 = unbounded (default ``(-1, -1)``):
  local attention, bottom-right aligned. Query row ``i`` may attend key
  ``j`` iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (a bound of
  -1 drops that side; see :func:`window_mask`). ``causal=True`` is
  ``right = 0`` and combines with ``left``. Rows with no key in their
  window are fully masked (``O = 0``, ``LSE = +inf``, zero gradients).
  (flash-attn's C++ entry also turns a bound ``>= seqlen_k`` into -1; that
  changes the mask only for ``right >= Sk``, on rows ``i < Sq - 1 - right``;
  callers mimicking it normalize ``window_size`` first.)
* ``softcap > 0``: the scaled score ``s = scale * q . k`` becomes
  ``softcap * tanh(s / softcap)`` (before ALiBi and masking); the backward
  multiplies ``dS`` by ``1 - tanh^2``. ``softcap = 0`` turns it off.
* ``alibi_slopes``: shape ``(nheads,)`` or ``(batch, nheads)`` (fp32 in
  flash-attn; any real dtype here): ``-slope * |i + Sk - Sq - j|`` is added
  to the (scaled, softcapped) score before the softmax, and so is part of
  the LSE. (flash-attn's causal kernel adds ``slope * j`` instead, which
  differs by a per-row constant: same ``O``, a different LSE.)
* Dropout: ``dropout_p`` in [0, 1) and ``dropout_mask``, bool
  ``(batch, nheads, Sq, Sk)``, True = kept (the reference draws no random
  numbers, so ``dropout_p > 0`` needs the mask; with ``dropout_p = 0`` a
  given mask must keep everything). ``O = (P * mask / (1 - p)) V``; the LSE
  is that of the undropped softmax (flash-attn's). The backward uses the
  same mask: ``dV = (P * Z)^T dO``, ``dP = (dO V^T) * Z`` with
  ``Z = mask / (1 - p)``, ``dS = P * (dP - rowsum(dO * O))``.
* Variable lengths: :func:`attention_varlen_naive` and
  :func:`attention_backward_varlen_naive` take flash-attn's packed layout
  (``q`` ``(total_q, nheads, d)``, ``k`` / ``v`` ``(total_k, nheads_kv,
  d)``, ``cu_seqlens_q`` / ``cu_seqlens_k`` prefix sums ``(batch + 1,)``)
  and return ``lse`` as ``(nheads, total_q)``. Each sequence is an
  independent problem (masks aligned with its own lengths; empty sequences
  allowed; the dropout mask is a list of per-sequence
  ``(nheads, Sq_b, Sk_b)`` arrays).

Non-finite inputs ("NaN in gives NaN out, in the affected rows"):

A NaN or +-inf anywhere in an input row that an output row actually reads
makes that whole output row NaN; every other row is exactly what it would be
with the non-finite values replaced by finite ones. Query row ``i`` (of one
batch and query head) reads its ``q`` row and the ``k`` / ``v`` rows of the
keys it may attend (its *visible* keys, see the causal rule and
``window_size`` above); a key row it may not attend is not read. Softcap,
ALiBi and dropout do not change which keys are visible (a dropped key still
counts as read). Row by row:

* ``lse[i]`` reads ``q[i]`` and the visible ``k`` rows (not ``v``);
  ``out[i]`` reads those and the visible ``v`` rows.
* Backward (``dout``, and for :func:`attention_backward_tiled` the given
  ``out`` and ``lse``, are read row by row too; an ``lse`` of NaN or -inf
  counts as non-finite, +inf is the fully masked value): row ``i`` is
  *affected* if its ``out[i]`` is, or ``dout[i]`` (or the given ``out[i]`` /
  ``lse[i]``) is non-finite. Then ``dq[i]`` is NaN for affected rows;
  ``dk[j]`` is NaN if some affected row sees key ``j``; ``dv[j]`` is NaN if
  some row that sees key ``j`` has a NaN ``lse`` (so a NaN P row) or a
  non-finite ``dout`` row (``dv = P^T dO`` reads neither ``v`` nor ``out``,
  so a non-finite ``v`` leaves ``dv`` finite).
  With GQA / MQA a kv head's gradient row is NaN if it is for any of the
  query heads that read it.
* Fully masked rows (no visible key) read nothing: they stay ``out = 0``,
  ``lse = +inf`` and contribute nothing to any gradient, whatever their
  ``q`` / ``dout`` rows hold.
* The low precision baselines (:func:`lowp_attention`,
  :func:`attention_grad_lowp`) apply the rule to the inputs rounded to their
  dtype (a finite value that rounds to +-inf counts as non-finite).

This follows torch's ``scaled_dot_product_attention`` (math path, CPU):
the rows that hold a non-finite value are the same, and the other rows agree.
The deliberate differences all come from "NaN in gives NaN out":

* torch can give +-inf, or NaN in one column only, where we give a whole NaN
  row (an inf in ``v`` gives +-inf in that column of ``out``; an inf or NaN
  in ``dout`` does the same in ``dv``);
* a +-inf in ``k`` gives torch a finite row wherever that key's score is
  -inf (it then has weight 0); we give NaN;
* torch's masked entries leak NaN (``0 * NaN``, ``NaN - inf``) into rows
  and keys that never see the non-finite value (with ``is_causal``, and in
  its causal backward); we do not.

Non-finite inputs raise no floating point warning: they are replaced by
zeros before the arithmetic, and the affected rows are set to NaN afterwards.
Overflow of finite inputs (scores beyond the float range) is not covered by
the rule; it propagates as IEEE arithmetic does.
"""

import functools
import math

import numpy as np

__all__ = [
    "causal_mask",
    "window_mask",
    "attention_naive",
    "attention_varlen_naive",
    "attention_backward_varlen_naive",
    "attention_tiled",
    "lowp_attention",
    "attention_backward_naive",
    "attention_backward_tiled",
    "attention_grad_lowp",
]


# ---------------------------------------------------------------------------
# Input handling
# ---------------------------------------------------------------------------

def _ignore_underflow(func):
    """Run ``func`` with numpy underflow ignored.

    Underflow (exp of very negative scores, tiny probabilities rounded to
    float16/bfloat16) is expected and harmless here; the caller's other
    floating point error settings are left alone.
    """
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        with np.errstate(under="ignore"):
            return func(*args, **kwargs)
    return wrapper


def _check_ndim(q, k, v, ndim: int, q_what: str, kv_what: str, got) -> None:
    """ValueError naming the first of q, k, v without ``ndim`` dimensions; ``got(x)`` ends
    the message."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != ndim:
            what = q_what if name == "q" else kv_what
            raise ValueError(f"{name} must be a {ndim}-D array {what}{got(x)}")


def _check_shapes(q, k, v):
    """Validate the shapes of q, k, v (arrays); return (B, Sq, Sk, H, Hkv, D)."""
    _check_ndim(q, k, v, 4, "(batch, seqlen_q, nheads, headdim)",
                "(batch, seqlen_k, nheads_kv, headdim)",
                lambda x: f", got ndim={x.ndim} (shape {x.shape})")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    batch, seqlen_q, nheads, headdim = q.shape
    batch_k, seqlen_k, nheads_kv, headdim_k = k.shape
    if batch_k != batch:
        raise ValueError(
            f"batch size of k/v ({batch_k}) does not match batch size of q "
            f"({batch})")
    if headdim_k != headdim:
        raise ValueError(
            f"headdim of k/v ({headdim_k}) does not match headdim of q "
            f"({headdim})")
    if headdim < 1:
        raise ValueError(f"headdim of q must be >= 1, got {headdim}")
    if nheads_kv < 1 or nheads % nheads_kv != 0:
        raise ValueError(
            f"nheads of q ({nheads}) must be a positive multiple of nheads_kv "
            f"of k/v ({nheads_kv})")
    return batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim


def _as_float64(q, k, v):
    q = np.asarray(q)
    k = np.asarray(k)
    v = np.asarray(v)
    dims = _check_shapes(q, k, v)
    return (np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64),
            np.asarray(v, dtype=np.float64), dims)


def _resolve_scale(softmax_scale, headdim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
    return scale


def _check_block_size(name, val):
    """Return ``val`` as an int, or raise ValueError if it is not >= 1."""
    if isinstance(val, bool) or int(val) != val or val < 1:
        raise ValueError(f"{name} must be a positive integer, got {val!r}")
    return int(val)


def _as_float64_shaped(name, x, shape, what):
    """``x`` as a float64 array of exactly ``shape`` (ValueError otherwise)."""
    x = np.asarray(x)
    if x.shape != tuple(shape):
        raise ValueError(
            f"{name} must have shape {tuple(shape)} {what}, got {x.shape}")
    return np.asarray(x, dtype=np.float64)


def _to_bhsd(x, nheads):
    """(B, S, Hx, D) -> (B, nheads, S, D), repeating kv heads for GQA/MQA.

    np.repeat along the head axis places kv head g at query heads
    g*group ... g*group + group - 1, i.e. query head h reads kv head h // group.
    """
    x = np.moveaxis(x, 2, 1)
    group = nheads // x.shape[1]
    if group > 1:
        x = np.repeat(x, group, axis=1)
    return x


def _sum_kv_groups(x, nheads_kv):
    """(B, nheads, S, D) -> (B, S, nheads_kv, D), summing each kv head's group.

    The adjoint of :func:`_to_bhsd`: query heads g*group ... g*group + group - 1
    all read kv head g, so their gradients add up into kv head g.
    """
    batch, nheads, seqlen, headdim = x.shape
    x = x.reshape(batch, nheads_kv, nheads // nheads_kv, seqlen, headdim)
    return np.ascontiguousarray(np.moveaxis(x.sum(axis=2), 1, 2))


def causal_mask(seqlen_q, seqlen_k):
    """Bottom-right aligned causal mask.

    Returns a bool array of shape ``(seqlen_q, seqlen_k)`` where ``True`` means
    "keep": entry ``(i, j)`` is True iff ``j <= i + (seqlen_k - seqlen_q)``.
    """
    seqlen_q = int(seqlen_q)
    seqlen_k = int(seqlen_k)
    if seqlen_q < 0 or seqlen_k < 0:
        raise ValueError(
            f"seqlen_q and seqlen_k must be >= 0, got {seqlen_q}, {seqlen_k}")
    rows = np.arange(seqlen_q)[:, None]
    cols = np.arange(seqlen_k)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


# ---------------------------------------------------------------------------
# Non-finite inputs (see "Non-finite inputs" in the module docstring)
# ---------------------------------------------------------------------------

def _nonfinite_rows(x, nheads):
    """(B, S, Hx, D) -> (B, nheads, S) bool: rows holding a NaN or +-inf.

    kv heads are repeated for GQA / MQA as in :func:`_to_bhsd`.
    """
    bad = np.moveaxis(~np.isfinite(x).all(axis=-1), 2, 1)   # (B, Hx, S)
    group = nheads // bad.shape[1]
    if group > 1:
        bad = np.repeat(bad, group, axis=1)
    return bad


def _finite_or_zero(x):
    """``x`` with every NaN / +-inf replaced by 0 (``x`` itself if finite).

    The arithmetic then runs on finite numbers only, so no floating point
    warning is raised and rows that do not read the replaced values are
    computed exactly as before; the rows that do are set to NaN afterwards.
    """
    finite = np.isfinite(x)
    if finite.all():
        return x
    return np.where(finite, x, np.zeros((), dtype=x.dtype))


def _resolve_window(window_size, causal):
    """Validate ``window_size`` and fold ``causal`` in: return ``(left, right)``.

    ``-1`` means unbounded; ``causal=True`` sets ``right = 0`` (flash-attn).
    """
    try:
        pair = tuple(window_size)
    except TypeError:
        pair = None
    if pair is None or len(pair) != 2 or not all(
            isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_))
            and w >= -1 for w in pair):
        raise ValueError(
            f"window_size must be a pair (left, right) of ints >= -1 "
            f"(-1 = unbounded), got {window_size!r}")
    left, right = int(pair[0]), int(pair[1])
    if causal:
        right = 0
    return left, right


def _key_ranges(seqlen_q, seqlen_k, window):
    """Per query row ``i`` the visible keys ``lo[i] <= j <= hi[i]`` (int arrays).

    Clipped to ``[0, seqlen_k - 1]``; ``lo > hi`` means no visible key.
    """
    left, right = window
    rows = np.arange(seqlen_q, dtype=np.int64)
    diag = rows + (seqlen_k - seqlen_q)
    lo = np.maximum(diag - left, 0) if left >= 0 else np.zeros_like(rows)
    hi = (np.minimum(diag + right, seqlen_k - 1) if right >= 0
          else np.full_like(rows, seqlen_k - 1))
    return lo, hi


def _row_ranges(seqlen_q, seqlen_k, window):
    """Per key ``j`` the query rows ``lo[j] <= i <= hi[j]`` that see it."""
    left, right = window
    cols = np.arange(seqlen_k, dtype=np.int64)
    diag = cols - (seqlen_k - seqlen_q)       # row i with i + offset == j
    lo = np.maximum(diag - right, 0) if right >= 0 else np.zeros_like(cols)
    hi = (np.minimum(diag + left, seqlen_q - 1) if left >= 0
          else np.full_like(cols, seqlen_q - 1))
    return lo, hi


def window_mask(seqlen_q, seqlen_k, window_size=(-1, -1), causal=False):
    """Bottom-right aligned local (sliding window) mask, flash-attn's definition.

    Returns a bool array ``(seqlen_q, seqlen_k)``, True = "keep": entry
    ``(i, j)`` is True iff
    ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``
    with ``(left, right) = window_size``; a bound of -1 drops that side, and
    ``causal=True`` sets ``right = 0``.
    """
    window = _resolve_window(window_size, causal)
    seqlen_q = int(seqlen_q)
    seqlen_k = int(seqlen_k)
    if seqlen_q < 0 or seqlen_k < 0:
        raise ValueError(
            f"seqlen_q and seqlen_k must be >= 0, got {seqlen_q}, {seqlen_k}")
    lo, hi = _key_ranges(seqlen_q, seqlen_k, window)
    cols = np.arange(seqlen_k)[None, :]
    return (cols >= lo[:, None]) & (cols <= hi[:, None])


def _keep_mask(seqlen_q, seqlen_k, window):
    """The (Sq, Sk) keep mask of ``window``, or None when nothing is masked."""
    if window == (-1, -1):
        return None
    lo, hi = _key_ranges(seqlen_q, seqlen_k, window)
    cols = np.arange(seqlen_k)[None, :]
    return (cols >= lo[:, None]) & (cols <= hi[:, None])


def _any_in_ranges(bad, lo, hi):
    """``bad`` (..., N) bool; ``lo``, ``hi`` (M,) inclusive ranges -> (..., M):
    whether ``bad`` holds a True in ``[lo[m], hi[m]]`` (False if empty)."""
    n = bad.shape[-1]
    counts = np.concatenate(
        [np.zeros(bad.shape[:-1] + (1,), dtype=np.int64),
         np.cumsum(bad, axis=-1, dtype=np.int64)], axis=-1)
    start = np.clip(lo, 0, n)
    stop = np.clip(hi + 1, 0, n)
    stop = np.maximum(stop, start)
    return (counts[..., stop] - counts[..., start]) > 0


def _rows_with_keys(seqlen_q, seqlen_k, window):
    """(seqlen_q,) bool: query rows that may attend at least one key."""
    lo, hi = _key_ranges(seqlen_q, seqlen_k, window)
    return lo <= hi


def _rows_seeing(bad_keys, seqlen_q, window):
    """(..., Sk) bool over keys -> (..., Sq): rows that see a marked key."""
    lo, hi = _key_ranges(seqlen_q, bad_keys.shape[-1], window)
    return _any_in_ranges(bad_keys, lo, hi)


def _keys_seen_by(bad_rows, seqlen_k, window):
    """(..., Sq) bool over query rows -> (..., Sk): keys a marked row sees."""
    lo, hi = _row_ranges(bad_rows.shape[-1], seqlen_k, window)
    return _any_in_ranges(bad_rows, lo, hi)


def _forward_nan_rows(q_bad, k_bad, v_bad, seqlen_k, window):
    """Rows of ``lse`` and of ``out`` that are NaN, each (B, H, Sq) bool.

    ``q_bad`` (B, H, Sq), ``k_bad`` and ``v_bad`` (B, H, Sk): the non-finite
    input rows (kv heads repeated per query head). ``window``: the resolved
    ``(left, right)`` of :func:`_resolve_window`.
    """
    seqlen_q = q_bad.shape[-1]
    has_keys = _rows_with_keys(seqlen_q, seqlen_k, window)
    lse_nan = has_keys & (q_bad | _rows_seeing(k_bad, seqlen_q, window))
    out_nan = lse_nan | _rows_seeing(v_bad, seqlen_q, window)
    return lse_nan, out_nan


def _backward_nan_rows(lse_nan, out_nan, do_bad, seqlen_k, window):
    """Rows of ``dq`` (B, H, Sq) and of ``dk``, ``dv`` (B, H, Sk) that are NaN.

    ``lse_nan``: rows whose P row is NaN; ``out_nan``: rows whose output (so
    whose ``D = rowsum(dO * O)``) is NaN; ``do_bad``: non-finite ``dout``
    rows. ``dk`` and ``dv`` are per query head, before the GQA sum.
    """
    has_keys = _rows_with_keys(lse_nan.shape[-1], seqlen_k, window)
    do_bad = do_bad & has_keys
    dq_nan = lse_nan | out_nan | do_bad          # the whole dS row is NaN
    dk_nan = _keys_seen_by(dq_nan, seqlen_k, window)
    dv_nan = _keys_seen_by(lse_nan | do_bad, seqlen_k, window)   # P^T dO
    return dq_nan, dk_nan, dv_nan


# ---------------------------------------------------------------------------
# Features: ALiBi, softcap, dropout (validation and score pipeline)
# ---------------------------------------------------------------------------

class _Features:
    """The validated feature keywords of one call (see the module docstring).

    ``window``: resolved ``(left, right)``; ``slopes``: (B, H) float64 or
    None; ``softcap``: float (0 = off); ``dropout_p``: float;
    ``drop_keep``: (B, H, Sq, Sk) bool or None (None when nothing is dropped);
    ``drop_scale``: ``1 / (1 - dropout_p)``.
    """

    def __init__(self, dims, causal, window_size, alibi_slopes, softcap,
                 dropout_p, dropout_mask):
        batch, seqlen_q, seqlen_k, nheads = dims[0], dims[1], dims[2], dims[3]
        self.window = _resolve_window(window_size, causal)
        self.softcap = _check_softcap(softcap)
        self.slopes = _check_alibi(alibi_slopes, batch, nheads)
        self.dropout_p = _check_dropout_p(dropout_p)
        self.drop_scale = 1.0 / (1.0 - self.dropout_p)
        self.drop_keep = _check_dropout_mask(
            dropout_mask, self.dropout_p,
            (batch, nheads, seqlen_q, seqlen_k),
            "(batch, nheads, seqlen_q, seqlen_k)")
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k

    def keep(self):
        return _keep_mask(self.seqlen_q, self.seqlen_k, self.window)

    def has_keys(self):
        return _rows_with_keys(self.seqlen_q, self.seqlen_k, self.window)

    def scores(self, s, i0=0, i1=None, j0=0, j1=None, rounded=None):
        """Softcap and ALiBi applied to the scaled scores ``s`` (..., m, n) of
        rows ``i0:i1`` and keys ``j0:j1``; returns ``(s, t)`` with ``t`` the
        softcap's tanh (None without softcap). ``rounded``: round each
        intermediate (the low precision baseline)."""
        rnd = rounded if rounded is not None else (lambda x: x)
        t = None
        if self.softcap > 0:
            cap = s.dtype.type(self.softcap)
            t = rnd(np.tanh(rnd(s / cap)))
            s = rnd(cap * t)
        if self.slopes is not None:
            i1 = self.seqlen_q if i1 is None else i1
            j1 = self.seqlen_k if j1 is None else j1
            s = rnd(s + _alibi_bias(self.slopes, self.seqlen_q, self.seqlen_k,
                                    i0, i1, j0, j1).astype(s.dtype))
        return s, t

    def drop_factor(self, i0=0, i1=None, j0=0, j1=None):
        """``keep / (1 - p)`` for rows i0:i1, keys j0:j1, or None (no dropout)."""
        if self.drop_keep is None:
            return None
        i1 = self.seqlen_q if i1 is None else i1
        j1 = self.seqlen_k if j1 is None else j1
        return self.drop_keep[:, :, i0:i1, j0:j1] * self.drop_scale


def _check_softcap(softcap):
    try:
        cap = float(softcap)
    except (TypeError, ValueError):
        cap = None
    if cap is None or isinstance(softcap, (bool, np.bool_)) or \
            not math.isfinite(cap) or cap < 0:
        raise ValueError(
            f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    return cap


def _check_alibi(alibi_slopes, batch, nheads):
    """``alibi_slopes`` as a (batch, nheads) float64 array, or None."""
    if alibi_slopes is None:
        return None
    slopes = np.asarray(alibi_slopes)
    if slopes.dtype.kind not in "fiu":
        raise ValueError(
            f"alibi_slopes must be a real (float32) array, got dtype "
            f"{slopes.dtype}")
    if slopes.shape not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes must have shape (nheads,) = ({nheads},) or "
            f"(batch, nheads) = ({batch}, {nheads}), got {slopes.shape}")
    slopes = slopes.astype(np.float64)
    if not np.isfinite(slopes).all():
        raise ValueError("alibi_slopes must be finite")
    return np.ascontiguousarray(np.broadcast_to(slopes, (batch, nheads)))


def _alibi_bias(slopes, seqlen_q, seqlen_k, i0, i1, j0, j1):
    """``-slope * |i + seqlen_k - seqlen_q - j|`` for rows i0:i1, keys j0:j1:
    (B, H, i1 - i0, j1 - j0) float64."""
    dist = np.abs(np.arange(i0, i1)[:, None] + (seqlen_k - seqlen_q)
                  - np.arange(j0, j1)[None, :]).astype(np.float64)
    return -slopes[:, :, None, None] * dist


def _check_dropout_p(dropout_p):
    try:
        p = float(dropout_p)
    except (TypeError, ValueError):
        p = None
    if p is None or isinstance(dropout_p, (bool, np.bool_)) or \
            not (0.0 <= p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return p


def _check_dropout_mask(dropout_mask, dropout_p, shape, what):
    """The validated dropout keep mask (bool, ``shape``) or None.

    ``dropout_p > 0`` needs the mask; with ``dropout_p == 0`` a given mask
    must keep everything (nothing is dropped), and None is returned.
    """
    if dropout_mask is None:
        if dropout_p > 0:
            raise ValueError(
                f"dropout_p={dropout_p} needs dropout_mask (a bool array "
                f"{what}, True = kept): the reference does not draw random "
                f"numbers")
        return None
    mask = np.asarray(dropout_mask)
    if mask.dtype != np.bool_:
        raise ValueError(
            f"dropout_mask must be a bool array (True = kept), got dtype "
            f"{mask.dtype}")
    if mask.shape != tuple(shape):
        raise ValueError(
            f"dropout_mask must have shape {tuple(shape)} {what}, got "
            f"{mask.shape}")
    if dropout_p == 0:
        if not mask.all():
            raise ValueError(
                "dropout_mask drops entries but dropout_p is 0 (with "
                "dropout_p = 0 nothing is dropped)")
        return None
    return mask


def _set_nan_rows(x, rows):
    """Set ``x[..., r, :]`` to NaN where ``rows[..., r]`` (in place)."""
    if rows.any():
        x[rows] = np.nan
    return x


def _masked_softmax_parts(s, keep):
    """Safe softmax pieces for scores ``s`` (..., M, N).

    ``keep`` is a bool array broadcastable to ``s`` or None. Returns
    ``(p, m, l)``: unnormalized probabilities ``exp(s - m)`` (0 where masked),
    the row max ``m`` (-inf for fully masked rows) and the row sum ``l``
    (0 for fully masked rows). -inf - (-inf) is never evaluated.
    """
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    m = np.max(s, axis=-1, initial=-np.inf)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - m_safe[..., None])
    l = np.sum(p, axis=-1)
    return p, m, l


def _finish(acc, m, l, has_keys):
    """Normalize the accumulator and form the LSE, handling empty rows.

    acc: (..., M, D), m and l: (..., M), has_keys: bool broadcastable to
    (..., M), the rows that may attend at least one key (decided by the mask,
    not by the values, so that a NaN never turns into an empty row). Rows
    without keys get O = 0 and LSE = +inf.
    """
    has_keys = np.broadcast_to(has_keys, l.shape)
    out = np.zeros_like(acc)
    np.divide(acc, l[..., None], out=out, where=has_keys[..., None])
    log_l = np.zeros_like(l)
    np.log(l, out=log_l, where=has_keys)
    lse = np.where(has_keys, m + log_l, np.inf)
    return out, lse


def _normalized(p, l, has_keys):
    """``p / l`` on the rows with keys, 0 on the rows without (see _finish)."""
    probs = np.zeros_like(p)
    np.divide(p, l[..., None], out=probs,
              where=np.broadcast_to(has_keys, l.shape)[..., None])
    return probs


# ---------------------------------------------------------------------------
# Naive attention
# ---------------------------------------------------------------------------

@_ignore_underflow
def attention_naive(q, k, v, softmax_scale=None, causal=False,
                    return_lse=False, *, window_size=(-1, -1),
                    alibi_slopes=None, softcap=0.0, dropout_p=0.0,
                    dropout_mask=None):
    """Exact attention computed directly in float64.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads, headdim)
    k, v : arrays, shape (batch, seqlen_k, nheads_kv, headdim)
        Any float dtype castable to float64 (float16, float32, float64,
        ml_dtypes.bfloat16). ``nheads`` must be a multiple of ``nheads_kv``.
    softmax_scale : float, optional
        Scale applied to ``q k^T``; defaults to ``1 / sqrt(headdim)``.
    causal : bool
        Apply the bottom-right aligned causal mask (see :func:`causal_mask`).
    return_lse : bool
        Also return the log-sum-exp of the scaled scores.
    window_size : (int, int), keyword-only
        ``(left, right)`` local attention window, -1 = unbounded (module
        docstring, "Features"); ``causal=True`` sets ``right = 0``.
    alibi_slopes : array (nheads,) or (batch, nheads), optional, keyword-only
        ALiBi slopes: ``-slope * |i + seqlen_k - seqlen_q - j|`` is added
        to the (scaled, softcapped) score.
    softcap : float, keyword-only
        ``> 0``: the scaled score ``s`` becomes ``softcap * tanh(s /
        softcap)``; 0 (default) turns it off.
    dropout_p : float in [0, 1), keyword-only
    dropout_mask : bool array (batch, nheads, seqlen_q, seqlen_k), keyword-only
        True = kept; required when ``dropout_p > 0``. Kept probabilities are
        scaled by ``1 / (1 - dropout_p)``; the LSE is the undropped one.

    Returns
    -------
    out : float64 array, shape (batch, seqlen_q, nheads, headdim)
    lse : float64 array, shape (batch, nheads, seqlen_q)
        Only if ``return_lse``. ``+inf`` for fully masked rows (whose ``out``
        row is 0).

    Rows that read a NaN or +-inf input are NaN (module docstring,
    "Non-finite inputs").
    """
    q, k, v, dims = _as_float64(q, k, v)
    _, seqlen_q, seqlen_k, nheads, _, headdim = dims
    scale = _resolve_scale(softmax_scale, headdim)
    feat = _Features(dims, causal, window_size, alibi_slopes, softcap,
                     dropout_p, dropout_mask)
    lse_nan, out_nan = _forward_nan_rows(
        _nonfinite_rows(q, nheads), _nonfinite_rows(k, nheads),
        _nonfinite_rows(v, nheads), seqlen_k, feat.window)

    qh = np.moveaxis(_finite_or_zero(q), 2, 1)    # (B, H, Sq, D)
    kh = _to_bhsd(_finite_or_zero(k), nheads)     # (B, H, Sk, D)
    vh = _to_bhsd(_finite_or_zero(v), nheads)

    s = np.matmul(qh, np.swapaxes(kh, -1, -2)) * scale   # (B, H, Sq, Sk)
    s, _ = feat.scores(s)
    p, m, l = _masked_softmax_parts(s, feat.keep())
    drop = feat.drop_factor()
    if drop is not None:
        p = p * drop             # the LSE below uses the undropped sum l
    acc = np.matmul(p, vh)                                # (B, H, Sq, D)
    out, lse = _finish(acc, m, l, feat.has_keys())
    _set_nan_rows(out, out_nan)
    _set_nan_rows(lse, lse_nan)
    out = np.ascontiguousarray(np.moveaxis(out, 1, 2))
    if return_lse:
        return out, lse
    return out


# ---------------------------------------------------------------------------
# Tiled (FlashAttention-2 forward) attention
# ---------------------------------------------------------------------------

@_ignore_underflow
def attention_tiled(q, k, v, softmax_scale=None, causal=False, block_m=64,
                    block_n=64, *, window_size=(-1, -1), alibi_slopes=None,
                    softcap=0.0, dropout_p=0.0, dropout_mask=None):
    """FlashAttention-2 forward pass, written block by block in float64.

    For each block of ``block_m`` query rows, the K/V blocks of ``block_n``
    rows are visited in order while a running row max ``m``, running row sum
    ``l`` and an unnormalized accumulator ``acc`` are kept (online softmax):

        S     = Q_i K_j^T * scale
        m_new = max(m, rowmax(S))
        P     = exp(S - m_new)
        alpha = exp(m - m_new)
        l     = alpha * l + rowsum(P)
        acc   = alpha * acc + P V_j

    and at the end ``O_i = acc / l`` and ``LSE_i = m + log(l)``. With
    ``causal=True`` or a window the K/V blocks that are masked for every row
    of the Q block are skipped, as in the kernel, and only the blocks
    crossing a band edge are masked element by element. Softcap and ALiBi
    are applied to ``S`` per block; with dropout ``acc`` accumulates
    ``(P * Z) V_j`` (``Z = mask / (1 - p)``) while ``l`` sums the undropped
    ``P``. Batch and heads are vectorized.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads, headdim)
    k, v : arrays, shape (batch, seqlen_k, nheads_kv, headdim)
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(headdim)``.
    causal : bool
        Bottom-right aligned causal mask.
    block_m, block_n : int
        Tile sizes along seqlen_q and seqlen_k (any positive integers).
    window_size, alibi_slopes, softcap, dropout_p, dropout_mask : keyword-only
        As for :func:`attention_naive`.

    Returns
    -------
    out : float64 array, shape (batch, seqlen_q, nheads, headdim)
    lse : float64 array, shape (batch, nheads, seqlen_q)
        ``+inf`` for fully masked rows (whose ``out`` row is 0).

    Rows that read a NaN or +-inf input are NaN, as in
    :func:`attention_naive` (module docstring, "Non-finite inputs").
    """
    block_m = _check_block_size("block_m", block_m)
    block_n = _check_block_size("block_n", block_n)

    q, k, v, dims = _as_float64(q, k, v)
    batch, seqlen_q, seqlen_k, nheads, _, headdim = dims
    scale = _resolve_scale(softmax_scale, headdim)
    feat = _Features(dims, causal, window_size, alibi_slopes, softcap,
                     dropout_p, dropout_mask)
    left, right = feat.window
    lse_nan, out_nan = _forward_nan_rows(
        _nonfinite_rows(q, nheads), _nonfinite_rows(k, nheads),
        _nonfinite_rows(v, nheads), seqlen_k, feat.window)
    has_keys = feat.has_keys()

    qh = np.moveaxis(_finite_or_zero(q), 2, 1)    # (B, H, Sq, D)
    kt = np.swapaxes(_to_bhsd(_finite_or_zero(k), nheads), -1, -2)  # (B,H,D,Sk)
    vh = _to_bhsd(_finite_or_zero(v), nheads)     # (B, H, Sk, D)
    # Row i keeps keys i + offset - left <= j <= i + offset + right.
    offset = seqlen_k - seqlen_q

    out = np.zeros((batch, nheads, seqlen_q, headdim))
    lse = np.full((batch, nheads, seqlen_q), np.inf)

    for i0 in range(0, seqlen_q, block_m):
        i1 = min(i0 + block_m, seqlen_q)
        q_blk = qh[:, :, i0:i1, :]
        rows = np.arange(i0, i1)

        m = np.full((batch, nheads, i1 - i0), -np.inf)
        l = np.zeros((batch, nheads, i1 - i0))
        acc = np.zeros((batch, nheads, i1 - i0, headdim))

        # Keys beyond the last row's right edge, or before the first row's
        # left edge, are masked for the whole block.
        n_end = min(seqlen_k, i1 + offset + right) if right >= 0 else seqlen_k
        n_start = max(0, i0 + offset - left) if left >= 0 else 0
        for j0 in range(n_start - n_start % block_n, max(n_end, 0), block_n):
            j1 = min(j0 + block_n, seqlen_k)
            s = np.matmul(q_blk, kt[:, :, :, j0:j1]) * scale
            s, _ = feat.scores(s, i0, i1, j0, j1)
            # Only blocks crossing a band edge need the element-wise mask.
            if ((right >= 0 and j1 - 1 > i0 + offset + right)
                    or (left >= 0 and j0 < i1 - 1 + offset - left)):
                cols = np.arange(j0, j1)[None, :]
                keep = cols <= rows[:, None] + offset + right if right >= 0 \
                    else np.ones((1, j1 - j0), dtype=bool)
                if left >= 0:
                    keep = keep & (cols >= rows[:, None] + offset - left)
                s = np.where(keep, s, -np.inf)

            m_new = np.maximum(m, np.max(s, axis=-1))
            # Rows that have seen no key yet keep m_new = -inf; shift by 0
            # there (their scores are all -inf, so P = 0 and alpha = 0).
            m_shift = np.where(np.isneginf(m_new), 0.0, m_new)
            p = np.exp(s - m_shift[..., None])
            alpha = np.exp(m - m_shift)
            l = alpha * l + np.sum(p, axis=-1)
            drop = feat.drop_factor(i0, i1, j0, j1)
            if drop is not None:
                p = p * drop
            acc = alpha[..., None] * acc + np.matmul(p, vh[:, :, j0:j1, :])
            m = m_new

        out[:, :, i0:i1, :], lse[:, :, i0:i1] = _finish(acc, m, l,
                                                        has_keys[i0:i1])

    _set_nan_rows(out, out_nan)
    _set_nan_rows(lse, lse_nan)
    return np.ascontiguousarray(np.moveaxis(out, 1, 2)), lse


# ---------------------------------------------------------------------------
# Naive attention backward
# ---------------------------------------------------------------------------

@_ignore_underflow
def attention_backward_naive(dout, q, k, v, softmax_scale=None,
                             causal=False, *, window_size=(-1, -1),
                             alibi_slopes=None, softcap=0.0, dropout_p=0.0,
                             dropout_mask=None):
    """Gradient of :func:`attention_naive`'s output, in closed form (float64).

    With ``S = scale * Q K^T``, ``P = softmax(S)`` (row-wise, masked) and
    ``O = P V``, the gradients of ``sum(dout * O)`` are

        dV = P^T dO
        dP = dO V^T
        D  = rowsum(dO * O)            (equals rowsum(P * dP))
        dS = P * (dP - D)
        dQ = scale * dS K
        dK = scale * dS^T Q

    computed on whole (seqlen_q, seqlen_k) matrices, batch and heads
    vectorized. With GQA / MQA, ``dK`` and ``dV`` of a kv head are summed over
    the query heads that share it. Masked entries and fully masked rows have
    ``P = 0`` and so contribute nothing.

    Parameters
    ----------
    dout : array, shape (batch, seqlen_q, nheads, headdim)
        Gradient of the loss with respect to the attention output.
    q : array, shape (batch, seqlen_q, nheads, headdim)
    k, v : arrays, shape (batch, seqlen_k, nheads_kv, headdim)
        Any float dtype castable to float64 (float16, float32, float64,
        ml_dtypes.bfloat16), as for :func:`attention_naive`.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(headdim)``.
    causal : bool
        Bottom-right aligned causal mask (see :func:`causal_mask`).
    window_size, alibi_slopes, softcap, dropout_p, dropout_mask : keyword-only
        As for :func:`attention_naive` (the same dropout mask as the
        forward's). With softcap, ``dS`` is multiplied by ``1 - tanh^2``
        before ``dQ`` and ``dK``; with dropout, ``dV = (P * Z)^T dO`` and
        ``dP = (dO V^T) * Z`` with ``Z = mask / (1 - dropout_p)``.

    Returns
    -------
    dq : float64 array, shape (batch, seqlen_q, nheads, headdim)
    dk, dv : float64 arrays, shape (batch, seqlen_k, nheads_kv, headdim)
        Gradient rows that depend on a NaN or +-inf input are NaN (module
        docstring, "Non-finite inputs").
    """
    q, k, v, dims = _as_float64(q, k, v)
    _, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = dims
    dout = _as_float64_shaped("dout", dout, q.shape, "(q's shape)")
    scale = _resolve_scale(softmax_scale, headdim)
    feat = _Features(dims, causal, window_size, alibi_slopes, softcap,
                     dropout_p, dropout_mask)
    dq_nan, dk_nan, dv_nan = _backward_nan_rows(
        *_forward_nan_rows(_nonfinite_rows(q, nheads),
                           _nonfinite_rows(k, nheads),
                           _nonfinite_rows(v, nheads), seqlen_k, feat.window),
        _nonfinite_rows(dout, nheads), seqlen_k, feat.window)

    qh = np.moveaxis(_finite_or_zero(q), 2, 1)    # (B, H, Sq, D)
    kh = _to_bhsd(_finite_or_zero(k), nheads)     # (B, H, Sk, D)
    vh = _to_bhsd(_finite_or_zero(v), nheads)
    do = np.moveaxis(_finite_or_zero(dout), 2, 1)  # (B, H, Sq, D)

    # Forward: P normalized, 0 on masked entries and on fully masked rows.
    s = np.matmul(qh, np.swapaxes(kh, -1, -2)) * scale   # (B, H, Sq, Sk)
    s, tanh = feat.scores(s)
    p, _, l = _masked_softmax_parts(s, feat.keep())
    probs = _normalized(p, l, feat.has_keys())
    drop = feat.drop_factor()
    probs_dropped = probs if drop is None else probs * drop
    out = np.matmul(probs_dropped, vh)                    # (B, H, Sq, D)

    # Backward.
    dv = np.matmul(np.swapaxes(probs_dropped, -1, -2), do)  # (B, H, Sk, D)
    dp = np.matmul(do, np.swapaxes(vh, -1, -2))           # (B, H, Sq, Sk)
    if drop is not None:
        dp = dp * drop
    delta = np.sum(do * out, axis=-1)                     # (B, H, Sq)
    ds = probs * (dp - delta[..., None])                  # (B, H, Sq, Sk)
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)     # d(softcap * tanh(s / softcap))
    dq = np.matmul(ds, kh) * scale                        # (B, H, Sq, D)
    dk = np.matmul(np.swapaxes(ds, -1, -2), qh) * scale   # (B, H, Sk, D)
    _set_nan_rows(dq, dq_nan)
    _set_nan_rows(dk, dk_nan)
    _set_nan_rows(dv, dv_nan)

    return (np.ascontiguousarray(np.moveaxis(dq, 1, 2)),
            _sum_kv_groups(dk, nheads_kv), _sum_kv_groups(dv, nheads_kv))


# ---------------------------------------------------------------------------
# Tiled (FlashAttention-2 backward) attention
# ---------------------------------------------------------------------------

@_ignore_underflow
def attention_backward_tiled(dout, q, k, v, out, lse, softmax_scale=None,
                             causal=False, block_q=64, block_k=64, *,
                             window_size=(-1, -1), alibi_slopes=None,
                             softcap=0.0, dropout_p=0.0, dropout_mask=None):
    """FlashAttention-2 backward pass, written block by block in float64.

    The algorithm of the FlashAttention-2 paper (Algorithm 2, backward; FA1
    Algorithm 4 without dropout). Nothing of size seqlen_q x seqlen_k is
    stored: ``P`` is recomputed per block from the LSE saved by the forward.

        preprocess:  D = rowsum(dO * O)                      (B, H, Sq)
        for each K/V block j (block_k rows):                 outer loop
            dK_j = 0, dV_j = 0
            for each Q block i (block_q rows):               inner loop
                S_ij  = scale * Q_i K_j^T
                P_ij  = exp(S_ij - LSE_i)
                dV_j += P_ij^T dO_i
                dP_ij = dO_i V_j^T
                dS_ij = P_ij * (dP_ij - D_i)
                dQ_i += scale * dS_ij K_j
                dK_j += scale * dS_ij^T Q_i
            write dK_j, dV_j

    In the kernel the outer loop is the thread-block grid (each block owns
    ``dK_j`` and ``dV_j`` in registers) and ``dQ_i`` is accumulated across
    K/V blocks in global memory; here the loops simply run in order.

    With ``causal=True`` or a window the Q blocks that see no key of K/V
    block ``j`` are skipped, and only the blocks crossing a band edge are
    masked element by element. Softcap and ALiBi are applied to ``S_ij``
    (and ``dS_ij`` is multiplied by ``1 - tanh^2``); with dropout
    ``dV_j += (P_ij * Z_ij)^T dO_i`` and ``dP_ij = (dO_i V_j^T) * Z_ij``. Rows with ``LSE = +inf`` (no visible key) get ``P = 0`` and add
    nothing. With GQA / MQA each query head is processed on its own and
    ``dK``, ``dV`` are summed over the query heads of a kv head at the end.
    Batch and heads are vectorized.

    Parameters
    ----------
    dout : array, shape (batch, seqlen_q, nheads, headdim)
        Gradient of the loss with respect to the attention output.
    q : array, shape (batch, seqlen_q, nheads, headdim)
    k, v : arrays, shape (batch, seqlen_k, nheads_kv, headdim)
    out : array, shape (batch, seqlen_q, nheads, headdim)
        The forward output, as returned by :func:`attention_tiled`,
        :func:`attention_naive` or a GPU kernel (any float dtype).
    lse : array, shape (batch, nheads, seqlen_q)
        The forward log-sum-exp (natural log, ``+inf`` for fully masked
        rows), float64 from this module or float32 from a GPU kernel.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(headdim)``. Must be the forward's scale.
    causal : bool
        Bottom-right aligned causal mask. Must be the forward's setting.
    block_q, block_k : int
        Tile sizes along seqlen_q and seqlen_k (any positive integers).
    window_size, alibi_slopes, softcap, dropout_p, dropout_mask : keyword-only
        As for :func:`attention_naive`; must be the forward's.

    Returns
    -------
    dq : float64 array, shape (batch, seqlen_q, nheads, headdim)
    dk, dv : float64 arrays, shape (batch, seqlen_k, nheads_kv, headdim)
        Gradient rows that depend on a NaN or +-inf input (``out`` and
        ``lse`` included; an ``lse`` of NaN or -inf counts) are NaN, as in
        :func:`attention_backward_naive`.
    """
    block_q = _check_block_size("block_q", block_q)
    block_k = _check_block_size("block_k", block_k)

    q, k, v, dims = _as_float64(q, k, v)
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = dims
    dout = _as_float64_shaped("dout", dout, q.shape, "(q's shape)")
    out = _as_float64_shaped("out", out, q.shape, "(q's shape)")
    lse = _as_float64_shaped("lse", lse, (batch, nheads, seqlen_q),
                             "(batch, nheads, seqlen_q)")
    scale = _resolve_scale(softmax_scale, headdim)
    feat = _Features(dims, causal, window_size, alibi_slopes, softcap,
                     dropout_p, dropout_mask)
    window = feat.window
    left, right = window
    # The given out and lse are read row by row as well: a NaN or -inf LSE
    # (+inf is the fully masked value) makes the row's P NaN, a non-finite
    # out row its D = rowsum(dO * O).
    lse_bad = np.isnan(lse) | np.isneginf(lse)
    lse_nan, out_nan = _forward_nan_rows(
        _nonfinite_rows(q, nheads) | lse_bad, _nonfinite_rows(k, nheads),
        _nonfinite_rows(v, nheads), seqlen_k, window)
    out_nan |= _nonfinite_rows(out, nheads) & _rows_with_keys(
        seqlen_q, seqlen_k, window)
    dq_nan, dk_nan, dv_nan = _backward_nan_rows(
        lse_nan, out_nan, _nonfinite_rows(dout, nheads), seqlen_k, window)
    # Affected rows are computed on zeros (and P = 0) and set to NaN below.
    lse = np.where(lse_bad, np.inf, lse)
    out = _finite_or_zero(out)

    qh = np.moveaxis(_finite_or_zero(q), 2, 1)    # (B, H, Sq, D)
    kh = _to_bhsd(_finite_or_zero(k), nheads)     # (B, H, Sk, D)
    vh = _to_bhsd(_finite_or_zero(v), nheads)
    do = np.moveaxis(_finite_or_zero(dout), 2, 1)  # (B, H, Sq, D)
    # Row i keeps keys i + offset - left <= j <= i + offset + right.
    offset = seqlen_k - seqlen_q

    # Preprocess: D_i = rowsum(dO_i * O_i).
    delta = np.sum(do * np.moveaxis(out, 2, 1), axis=-1)   # (B, H, Sq)

    dq = np.zeros((batch, nheads, seqlen_q, headdim))
    dk = np.zeros((batch, nheads, seqlen_k, headdim))      # per query head
    dv = np.zeros((batch, nheads, seqlen_k, headdim))

    for j0 in range(0, seqlen_k, block_k):
        j1 = min(j0 + block_k, seqlen_k)
        k_blk = kh[:, :, j0:j1, :]
        v_blk = vh[:, :, j0:j1, :]
        cols = np.arange(j0, j1)
        dk_blk = np.zeros((batch, nheads, j1 - j0, headdim))
        dv_blk = np.zeros((batch, nheads, j1 - j0, headdim))

        # Row i sees key j0 only if i >= j0 - offset - right, and key j1 - 1
        # only if i <= j1 - 1 - offset + left: Q blocks outside these rows
        # see none of this K/V block and are skipped.
        first_row = max(0, j0 - offset - right) if right >= 0 else 0
        last_row = (min(seqlen_q - 1, j1 - 1 - offset + left) if left >= 0
                    else seqlen_q - 1)
        for i0 in range(first_row - first_row % block_q, last_row + 1,
                        block_q):
            i1 = min(i0 + block_q, seqlen_q)
            q_blk = qh[:, :, i0:i1, :]
            do_blk = do[:, :, i0:i1, :]

            s = np.matmul(q_blk, np.swapaxes(k_blk, -1, -2)) * scale
            s, tanh = feat.scores(s, i0, i1, j0, j1)
            # Only blocks crossing a band edge need the element-wise mask.
            if ((right >= 0 and j1 - 1 > i0 + offset + right)
                    or (left >= 0 and j0 < i1 - 1 + offset - left)):
                rows = np.arange(i0, i1)[:, None]
                keep = cols[None, :] <= rows + offset + right if right >= 0 \
                    else np.ones((1, j1 - j0), dtype=bool)
                if left >= 0:
                    keep = keep & (cols[None, :] >= rows + offset - left)
                s = np.where(keep, s, -np.inf)
            # exp(-inf) = 0 for masked entries; LSE = +inf rows give
            # S - LSE = -inf (never inf - inf, since S < +inf), so P = 0.
            p = np.exp(s - lse[:, :, i0:i1, None])

            drop = feat.drop_factor(i0, i1, j0, j1)
            p_dropped = p if drop is None else p * drop
            dv_blk += np.matmul(np.swapaxes(p_dropped, -1, -2), do_blk)
            dp = np.matmul(do_blk, np.swapaxes(v_blk, -1, -2))
            if drop is not None:
                dp = dp * drop
            ds = p * (dp - delta[:, :, i0:i1, None])
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            dq[:, :, i0:i1, :] += np.matmul(ds, k_blk) * scale
            dk_blk += np.matmul(np.swapaxes(ds, -1, -2), q_blk) * scale

        dk[:, :, j0:j1, :] = dk_blk
        dv[:, :, j0:j1, :] = dv_blk

    _set_nan_rows(dq, dq_nan)
    _set_nan_rows(dk, dk_nan)
    _set_nan_rows(dv, dv_nan)
    return (np.ascontiguousarray(np.moveaxis(dq, 1, 2)),
            _sum_kv_groups(dk, nheads_kv), _sum_kv_groups(dv, nheads_kv))


# ---------------------------------------------------------------------------
# Low precision baseline
# ---------------------------------------------------------------------------

def _resolve_lowp_dtype(dtype):
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        import ml_dtypes  # optional dependency, only needed for bf16
        return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(
            f"dtype must be np.float16 or ml_dtypes.bfloat16, got {dtype!r}"
        ) from exc
    if dt == np.float16 or dt.name == "bfloat16":
        return dt
    raise ValueError(
        f"dtype must be np.float16 or ml_dtypes.bfloat16, got {dtype!r}")


@_ignore_underflow
def lowp_attention(q, k, v, softmax_scale=None, causal=False,
                   dtype=np.float16, *, window_size=(-1, -1), alibi_slopes=None,
                   softcap=0.0, dropout_p=0.0, dropout_mask=None):
    """Plain (non-tiled) attention computed in the same low precision.

    This is the error baseline of the FlashAttention test rule: a kernel's
    error against the float64 oracle should be comparable to this function's.

    Steps: round q, k, v to ``dtype``; ``S = (q k^T) * scale`` accumulated in
    float32 and rounded to ``dtype``; softmax in float32 (masked as in
    :func:`attention_naive`) with ``P`` rounded to ``dtype``; ``O = P v``
    accumulated in float32 and rounded to ``dtype``.

    The features round every intermediate to ``dtype`` too: softcap
    ``t = tanh(S / softcap)`` (the quotient and ``t`` rounded) and
    ``S = softcap * t`` (rounded); ALiBi ``S = S + bias`` (bias in float32,
    the sum rounded); dropout ``P * mask / (1 - p)`` (rounded) replaces
    ``P`` in ``O = P v``.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads, headdim)
    k, v : arrays, shape (batch, seqlen_k, nheads_kv, headdim)
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(headdim)``.
    causal : bool
        Bottom-right aligned causal mask.
    dtype : np.float16 or ml_dtypes.bfloat16 (or the string "bfloat16")
        ml_dtypes is imported only when bfloat16 is requested by name.
    window_size, alibi_slopes, softcap, dropout_p, dropout_mask : keyword-only
        As for :func:`attention_naive`.

    Returns
    -------
    out : float64 array, shape (batch, seqlen_q, nheads, headdim)
        The low precision result converted to float64 (fully masked rows 0;
        rows that read a NaN or +-inf input after rounding to ``dtype`` are
        NaN).
    """
    lowp = _resolve_lowp_dtype(dtype)
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    feat = _Features(_check_shapes(q, k, v), causal, window_size,
                     alibi_slopes, softcap, dropout_p, dropout_mask)
    _, _, vh, _, probs_dropped, _, rounded, (_, out_nan) = _lowp_forward(
        q, k, v, softmax_scale, feat, lowp)
    o = _set_nan_rows(rounded(np.matmul(probs_dropped, vh)), out_nan)
    return np.ascontiguousarray(np.moveaxis(o, 1, 2)).astype(np.float64)


def _lowp_forward(q, k, v, softmax_scale, feat, lowp):
    """The forward of plain attention in low precision, up to P (see lowp_attention).

    Returns (qh, kh, vh, probs, probs_dropped, tanh, rounded, (lse_nan, out_nan)):
    the rounded inputs as (B, H, S, D) float32 (non-finite values replaced by 0), the
    rounded probabilities P, the rounded dropped ``P * mask / (1 - p)`` (P itself without
    dropout), the rounded softcap tanh (None without softcap), the rounding function (to
    ``lowp``, back to float32) and the (B, H, Sq) rows whose P and whose output read a
    non-finite rounded input (see _forward_nan_rows). ``feat``: a _Features.
    """
    _, seqlen_q, seqlen_k, nheads, _, headdim = _check_shapes(q, k, v)
    scale = np.float32(_resolve_scale(softmax_scale, headdim))

    def rounded(x):
        return x.astype(lowp).astype(np.float32)

    def rounded_input(x):
        # Saturating to +-inf is the low precision input's value (a
        # non-finite input for the NaN rule), not an error of the baseline.
        with np.errstate(over="ignore"):
            return rounded(x)

    q, k, v = rounded_input(q), rounded_input(k), rounded_input(v)
    nan_rows = _forward_nan_rows(
        _nonfinite_rows(q, nheads), _nonfinite_rows(k, nheads),
        _nonfinite_rows(v, nheads), seqlen_k, feat.window)
    qh = np.moveaxis(_finite_or_zero(q), 2, 1)    # (B, H, Sq, D)
    kh = _to_bhsd(_finite_or_zero(k), nheads)     # (B, H, Sk, D)
    vh = _to_bhsd(_finite_or_zero(v), nheads)
    s = rounded(np.matmul(qh, np.swapaxes(kh, -1, -2)) * scale)
    s, tanh = feat.scores(s, rounded=rounded)
    p, _, l = _masked_softmax_parts(s, feat.keep())
    probs = rounded(_normalized(p, l, feat.has_keys()))
    drop = feat.drop_factor()
    probs_dropped = probs if drop is None else rounded(
        probs * drop.astype(np.float32))
    return qh, kh, vh, probs, probs_dropped, tanh, rounded, nan_rows


@_ignore_underflow
def attention_grad_lowp(dout, q, k, v, softmax_scale=None, causal=False,
                        dtype=np.float16, *, window_size=(-1, -1),
                        alibi_slopes=None, softcap=0.0, dropout_p=0.0,
                        dropout_mask=None):
    """Gradients of plain (non-tiled) attention computed in low precision.

    The backward counterpart of :func:`lowp_attention`, and the error baseline
    of the FlashAttention test rule for gradients: a kernel's gradient error
    against :func:`attention_backward_naive` should be within a small factor
    of this function's. It follows what autograd does for plain attention
    in ``dtype``: every matmul takes operands in ``dtype``, accumulates in
    float32 and rounds its result to ``dtype``; the softmax and its backward
    run in float32 on ``dtype`` operands and round their result.

    Rounded to ``dtype`` (each then used as a float32 value):

    * the inputs ``q``, ``k``, ``v``, ``dout``;
    * forward, exactly as :func:`lowp_attention`: ``S = (q k^T) * scale``
      and ``P = softmax(S)`` (masked; fully masked rows give ``P = 0``);
      ``O`` is not needed;
    * ``dP = dout v^T``;
    * ``dS = P * (dP - rowsum(P * dP))``, evaluated in float32 (the softmax
      backward written with ``rowsum(P * dP)``, which is what autograd uses;
      it equals ``rowsum(dO * O)`` in exact arithmetic);
    * the outputs ``dv = P^T dout``, ``dq = (dS k) * scale`` and
      ``dk = (dS^T q) * scale``, each rounded once; the scale is applied to
      the float32 accumulator, and with GQA / MQA the sum over a kv head's
      query heads is part of the same float32 accumulation.

    Features (as :func:`lowp_attention` in the forward): with dropout
    ``dP = (dout v^T) * mask / (1 - p)`` is rounded again, ``P`` in
    ``rowsum(P * dP)`` and ``dS`` is the undropped one and ``dv`` uses the
    dropped ``P``; with softcap ``dS`` is multiplied by ``1 - t^2`` (``t``
    the forward's rounded tanh, evaluated in float32) and rounded again.

    Parameters
    ----------
    dout : array, shape (batch, seqlen_q, nheads, headdim)
    q : array, shape (batch, seqlen_q, nheads, headdim)
    k, v : arrays, shape (batch, seqlen_k, nheads_kv, headdim)
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(headdim)``.
    causal : bool
        Bottom-right aligned causal mask.
    dtype : np.float16 or ml_dtypes.bfloat16 (or the string "bfloat16")
    window_size, alibi_slopes, softcap, dropout_p, dropout_mask : keyword-only
        As for :func:`attention_naive`.

    Returns
    -------
    dq : float64 array, shape (batch, seqlen_q, nheads, headdim)
    dk, dv : float64 arrays, shape (batch, seqlen_k, nheads_kv, headdim)
        The low precision results converted to float64 (NaN rows as in
        :func:`attention_backward_naive`, for the inputs rounded to
        ``dtype``).
    """
    lowp = _resolve_lowp_dtype(dtype)
    q, k, v, dout = np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(dout)
    dims = _check_shapes(q, k, v)
    _, _, seqlen_k, nheads, nheads_kv, headdim = dims
    if dout.shape != q.shape:
        raise ValueError(
            f"dout must have shape {q.shape} (q's shape), got {dout.shape}")
    scale = np.float32(_resolve_scale(softmax_scale, headdim))
    feat = _Features(dims, causal, window_size, alibi_slopes, softcap,
                     dropout_p, dropout_mask)
    # Forward, as lowp_attention.
    qh, kh, vh, probs, probs_dropped, tanh, rounded, nan_rows = _lowp_forward(
        q, k, v, softmax_scale, feat, lowp)
    with np.errstate(over="ignore"):   # as the inputs in _lowp_forward
        dout = rounded(dout)
    dq_nan, dk_nan, dv_nan = _backward_nan_rows(
        *nan_rows, _nonfinite_rows(dout, nheads), seqlen_k, feat.window)
    do = np.moveaxis(_finite_or_zero(dout), 2, 1)

    # Backward.
    dp = rounded(np.matmul(do, np.swapaxes(vh, -1, -2)))
    drop = feat.drop_factor()
    if drop is not None:
        dp = rounded(dp * drop.astype(np.float32))
    ds = rounded(probs * (dp - np.sum(probs * dp, axis=-1, keepdims=True)))
    if tanh is not None:
        ds = rounded(ds * (np.float32(1) - tanh * tanh))
    dq = _set_nan_rows(rounded(np.matmul(ds, kh) * scale), dq_nan)
    dk = rounded(_sum_kv_groups(_set_nan_rows(
        np.matmul(np.swapaxes(ds, -1, -2), qh) * scale, dk_nan), nheads_kv))
    dv = rounded(_sum_kv_groups(_set_nan_rows(
        np.matmul(np.swapaxes(probs_dropped, -1, -2), do), dv_nan), nheads_kv))
    return (np.moveaxis(dq, 1, 2).astype(np.float64), dk.astype(np.float64),
            dv.astype(np.float64))


# ---------------------------------------------------------------------------
# Variable length (packed) sequences
# ---------------------------------------------------------------------------

def _check_cu_seqlens(name, cu_seqlens, total):
    """``cu_seqlens`` as an int64 array, validated against ``total`` rows."""
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 1 or cu.dtype.kind not in "iu":
        raise ValueError(
            f"{name} must be a 1-D integer array (batch + 1,) of prefix sums, "
            f"got dtype {cu.dtype} and shape {cu.shape}")
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {cu[0]}")
    if np.any(np.diff(cu) < 0):
        raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
    if cu[-1] != total:
        raise ValueError(
            f"{name} must end at the total number of rows ({total}), got "
            f"{cu[-1]}")
    return cu


def _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, window_size, softcap,
                  alibi_slopes, dropout_p, dropout_mask):
    """Validate the packed layout; return (q, k, v, cu_q, cu_k, per-seq getters)."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    _check_ndim(q, k, v, 3, "(total_q, nheads, headdim)", "(total_k, nheads_kv, headdim)",
                lambda x: f" (varlen packed layout), got shape {x.shape}")
    _check_shapes(q[None], k[None], v[None])  # the dense rules, batch 1 (k and v shapes too)
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if cu_q.size != cu_k.size:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length "
            f"(batch + 1), got {cu_q.size} and {cu_k.size}")
    batch, nheads = cu_q.size - 1, q.shape[1]
    _resolve_window(window_size, False)
    _check_softcap(softcap)
    if alibi_slopes is not None:
        # Validated here against the whole batch; passed per sequence.
        slopes = _check_alibi(alibi_slopes, batch, nheads)
    dropout_p = _check_dropout_p(dropout_p)
    if dropout_mask is not None:
        if isinstance(dropout_mask, np.ndarray) or \
                len(dropout_mask) != batch:
            raise ValueError(
                f"dropout_mask must be a list of {batch} per-sequence bool "
                f"arrays (nheads, seqlen_q_b, seqlen_k_b) for varlen")
    elif dropout_p > 0:
        raise ValueError(
            f"dropout_p={dropout_p} needs dropout_mask (a list of per-sequence "
            f"bool arrays (nheads, seqlen_q_b, seqlen_k_b), True = kept)")

    def seq(b):
        sq = slice(cu_q[b], cu_q[b + 1])
        sk = slice(cu_k[b], cu_k[b + 1])
        kw = {"alibi_slopes": None if alibi_slopes is None else slopes[b],
              "dropout_p": dropout_p, "dropout_mask": None}
        if dropout_mask is not None:
            mask = np.asarray(dropout_mask[b])
            shape = (nheads, cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b])
            if mask.shape != shape:
                raise ValueError(
                    f"dropout_mask[{b}] must have shape {shape} (nheads, "
                    f"seqlen_q_b, seqlen_k_b), got {mask.shape}")
            kw["dropout_mask"] = mask[None]
        return sq, sk, kw

    return q, k, v, cu_q, cu_k, seq


def attention_varlen_naive(q, k, v, cu_seqlens_q, cu_seqlens_k,
                           softmax_scale=None, causal=False, return_lse=False,
                           *, window_size=(-1, -1), alibi_slopes=None,
                           softcap=0.0, dropout_p=0.0, dropout_mask=None):
    """:func:`attention_naive` on flash-attn's packed variable-length layout.

    Parameters
    ----------
    q : array, shape (total_q, nheads, headdim)
    k, v : arrays, shape (total_k, nheads_kv, headdim)
    cu_seqlens_q, cu_seqlens_k : int arrays, shape (batch + 1,)
        Prefix sums of the sequence lengths (int32 in flash-attn): sequence
        ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of ``q`` and
        ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of ``k`` / ``v``. They
        start at 0, do not decrease and end at ``total_q`` / ``total_k``;
        empty sequences are allowed.
    softmax_scale, causal, return_lse, window_size, softcap, dropout_p :
        As for :func:`attention_naive`; causal and window are bottom-right
        aligned per sequence (with that sequence's own lengths).
    alibi_slopes : array (nheads,) or (batch, nheads), optional
    dropout_mask : list of ``batch`` bool arrays (nheads, seqlen_q_b, seqlen_k_b)
        Required when ``dropout_p > 0``; True = kept.

    Returns
    -------
    out : float64 array, shape (total_q, nheads, headdim)
    lse : float64 array, shape (nheads, total_q)
        Only if ``return_lse`` (flash-attn 2.x varlen layout).

    Each sequence is an independent problem, computed by
    :func:`attention_naive` with batch 1.
    """
    q, k, v, cu_q, cu_k, seq = _varlen_setup(
        q, k, v, cu_seqlens_q, cu_seqlens_k, window_size, softcap,
        alibi_slopes, dropout_p, dropout_mask)
    out = np.zeros(q.shape, dtype=np.float64)
    lse = np.full((q.shape[1], q.shape[0]), np.inf)
    for b in range(cu_q.size - 1):
        sq, sk, kw = seq(b)
        o, l = attention_naive(
            q[None, sq], k[None, sk], v[None, sk], softmax_scale, causal,
            True, window_size=window_size, softcap=softcap, **kw)
        out[sq] = o[0]
        lse[:, sq] = l[0]
    if return_lse:
        return out, lse
    return out


def attention_backward_varlen_naive(dout, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                    softmax_scale=None, causal=False, *,
                                    window_size=(-1, -1), alibi_slopes=None,
                                    softcap=0.0, dropout_p=0.0,
                                    dropout_mask=None):
    """:func:`attention_backward_naive` on the packed varlen layout.

    Arguments as for :func:`attention_varlen_naive`, plus ``dout`` of
    ``q``'s shape (total_q, nheads, headdim). Returns ``dq`` (total_q,
    nheads, headdim) and ``dk``, ``dv`` (total_k, nheads_kv, headdim), all
    float64; each sequence is computed by :func:`attention_backward_naive`
    with batch 1.
    """
    q, k, v, cu_q, cu_k, seq = _varlen_setup(
        q, k, v, cu_seqlens_q, cu_seqlens_k, window_size, softcap,
        alibi_slopes, dropout_p, dropout_mask)
    dout = np.asarray(dout)
    if dout.shape != q.shape:
        raise ValueError(
            f"dout must have shape {q.shape} (q's shape), got {dout.shape}")
    dq = np.zeros(q.shape, dtype=np.float64)
    dk = np.zeros(k.shape, dtype=np.float64)
    dv = np.zeros(v.shape, dtype=np.float64)
    for b in range(cu_q.size - 1):
        sq, sk, kw = seq(b)
        g = attention_backward_naive(
            dout[None, sq], q[None, sq], k[None, sk], v[None, sk],
            softmax_scale, causal, window_size=window_size, softcap=softcap,
            **kw)
        dq[sq], dk[sk], dv[sk] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


# ---------------------------------------------------------------------------
# Split-KV (flash-decoding) partials and their LSE combine
# ---------------------------------------------------------------------------

__all__ += ["attention_splitkv_partials", "combine_splits", "apply_rotary",
            "attention_kvcache"]


def _split_bounds(seqlen_k, num_splits, block_n=1):
    """The key ranges ``[(j0, j1)]`` of the ``num_splits`` splits (contiguous, in order).

    The keys are cut into ``ceil(seqlen_k / block_n)`` blocks of ``block_n``;
    split ``s`` takes blocks ``s * c .. (s + 1) * c - 1`` with
    ``c = ceil(n_blocks / num_splits)`` (flash-attn's ``n_blocks_per_split``),
    so trailing splits can be empty (``j0 == j1``) when there are more splits
    than blocks.
    """
    n_blocks = -(-seqlen_k // block_n)
    per_split = -(-n_blocks // num_splits) if n_blocks else 0
    bounds = []
    for s in range(num_splits):
        j0 = min(s * per_split * block_n, seqlen_k)
        j1 = min((s + 1) * per_split * block_n, seqlen_k)
        bounds.append((j0, j1))
    return bounds


@_ignore_underflow
def attention_splitkv_partials(q, k, v, num_splits, softmax_scale=None,
                               causal=False, *, block_n=1, window_size=(-1, -1),
                               alibi_slopes=None, softcap=0.0, dropout_p=0.0,
                               dropout_mask=None):
    """The per-split partial results of split-KV (flash-decoding) attention, float64.

    The keys are cut into ``num_splits`` contiguous chunks (``block_n = 1``:
    ``ceil(seqlen_k / num_splits)`` keys each, the last ones shorter or empty;
    ``block_n > 1``: whole blocks of ``block_n`` keys, ``ceil(n_blocks /
    num_splits)`` blocks a split, as flash-attn's split kernel cuts them).
    Split ``s`` is exact attention of every query row over its chunk only,
    with the masks (causal, window), softcap, ALiBi and dropout of the whole
    problem (positions are those of the full key range, bottom-right aligned
    with the full ``seqlen_k``).

    Convention (flash-attn's split kernel; it makes :func:`combine_splits`
    exact): a row with no visible key *in that split* gets ``O = 0`` and
    ``LSE = -inf`` (weight ``exp(-inf) = 0`` in the combine), not the ``+inf``
    of a fully masked row of the whole problem. Rows that read a non-finite
    input inside the split are NaN (the module's rule, per split).

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads, headdim)
    k, v : arrays, shape (batch, seqlen_k, nheads_kv, headdim)
    num_splits : int >= 1
        May exceed the number of keys (the extra splits are empty).
    softmax_scale, causal, window_size, alibi_slopes, softcap, dropout_p,
    dropout_mask : as for :func:`attention_naive`.
    block_n : int >= 1, keyword-only
        Split granularity in keys.

    Returns
    -------
    out_partial : float64 array (num_splits, batch, seqlen_q, nheads, headdim)
        Each split's normalized output ``P_s V_s / l_s`` (dropout applied).
    lse_partial : float64 array (num_splits, batch, nheads, seqlen_q)
        Each split's (undropped) log-sum-exp; ``-inf`` where the split has no
        visible key for the row.
    """
    num_splits = _check_block_size("num_splits", num_splits)
    block_n = _check_block_size("block_n", block_n)
    q, k, v, dims = _as_float64(q, k, v)
    batch, seqlen_q, seqlen_k, nheads, _, headdim = dims
    scale = _resolve_scale(softmax_scale, headdim)
    feat = _Features(dims, causal, window_size, alibi_slopes, softcap,
                     dropout_p, dropout_mask)
    q_bad = _nonfinite_rows(q, nheads)            # (B, H, Sq)
    k_bad = _nonfinite_rows(k, nheads)            # (B, H, Sk)
    v_bad = _nonfinite_rows(v, nheads)
    qh = np.moveaxis(_finite_or_zero(q), 2, 1)    # (B, H, Sq, D)
    kh = _to_bhsd(_finite_or_zero(k), nheads)     # (B, H, Sk, D)
    vh = _to_bhsd(_finite_or_zero(v), nheads)
    s_all = np.matmul(qh, np.swapaxes(kh, -1, -2)) * scale
    s_all, _ = feat.scores(s_all)
    keep_all = feat.keep()
    if keep_all is None:
        keep_all = np.ones((seqlen_q, seqlen_k), dtype=bool)
    drop = feat.drop_factor()

    out_p = np.zeros((num_splits, batch, seqlen_q, nheads, headdim))
    lse_p = np.full((num_splits, batch, nheads, seqlen_q), -np.inf)
    for split, (j0, j1) in enumerate(_split_bounds(seqlen_k, num_splits, block_n)):
        keep = keep_all[:, j0:j1]                 # (Sq, n)
        has_keys = keep.any(axis=-1)              # (Sq,)
        if not has_keys.any():
            continue
        p, m, l = _masked_softmax_parts(s_all[..., j0:j1], keep)
        if drop is not None:
            p = p * drop[..., j0:j1]
        acc = np.matmul(p, vh[:, :, j0:j1])
        out, lse = _finish(acc, m, l, has_keys)
        lse = np.where(has_keys, lse, -np.inf)
        lse_nan = has_keys & (q_bad | (k_bad[:, :, None, j0:j1] & keep).any(-1))
        out_nan = lse_nan | (v_bad[:, :, None, j0:j1] & keep).any(-1)
        _set_nan_rows(out, out_nan)
        _set_nan_rows(lse, lse_nan)
        out_p[split] = np.moveaxis(out, 1, 2)
        lse_p[split] = lse
    return out_p, lse_p


@_ignore_underflow
def combine_splits(out_partial, lse_partial):
    """Merge split-KV partials into the full result: flash-decoding's LSE combine.

    With ``L = log(sum_s exp(lse_s))`` (computed as ``M + log(sum_s exp(lse_s
    - M))``, ``M = max_s lse_s``), ``lse = L`` and ``out = sum_s exp(lse_s -
    L) * out_s``. This is exact: on :func:`attention_splitkv_partials`'s
    output it equals :func:`attention_naive` (to float64 rounding) for any
    number of splits.

    Conventions: a split with ``lse_s = -inf`` has no key for the row and
    weight 0 (its ``out_s`` is not read); a row whose every split is ``-inf``
    is fully masked: ``out = 0``, ``lse = +inf`` (as everywhere in cuflash).
    A NaN ``lse_s`` makes the row's ``lse`` and ``out`` NaN; a non-finite
    ``out_s`` of a split with a finite ``lse_s`` makes the row's ``out`` NaN.
    ``+inf`` in ``lse_partial`` is rejected (partials mark an empty split with
    ``-inf``, not with the fully masked ``+inf``).

    Parameters
    ----------
    out_partial : array (num_splits, batch, seqlen_q, nheads, headdim)
    lse_partial : array (num_splits, batch, nheads, seqlen_q)

    Returns
    -------
    out : float64 array (batch, seqlen_q, nheads, headdim)
    lse : float64 array (batch, nheads, seqlen_q)
    """
    out_p = np.asarray(out_partial)
    lse_p = np.asarray(lse_partial)
    if out_p.ndim != 5:
        raise ValueError(
            f"out_partial must be a 5-D array (num_splits, batch, seqlen_q, "
            f"nheads, headdim), got shape {out_p.shape}")
    splits, batch, seqlen_q, nheads, _ = out_p.shape
    if splits < 1:
        raise ValueError("out_partial must hold at least one split (num_splits >= 1)")
    if lse_p.shape != (splits, batch, nheads, seqlen_q):
        raise ValueError(
            f"lse_partial must have shape (num_splits, batch, nheads, seqlen_q) "
            f"= {(splits, batch, nheads, seqlen_q)}, got {lse_p.shape}")
    out_p = out_p.astype(np.float64)
    lse_p = lse_p.astype(np.float64)
    if np.isposinf(lse_p).any():
        raise ValueError(
            "lse_partial holds +inf: a split without keys must have lse = -inf "
            "(the +inf convention is for fully masked rows of a whole result)")
    lse_nan = np.isnan(lse_p)
    live = ~lse_nan & ~np.isneginf(lse_p)                 # (S, B, H, Sq)
    safe = np.where(live, lse_p, -np.inf)
    m = np.max(safe, axis=0)                              # (B, H, Sq)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    total = np.sum(np.exp(safe - m_safe), axis=0)         # exp(-inf) = 0
    has = total > 0
    log_total = np.zeros_like(total)
    np.log(total, out=log_total, where=has)
    lse = np.where(has, m_safe + log_total, np.inf)
    lse_fin = np.where(has, lse, 0.0)
    weight = np.where(live, np.exp(safe - lse_fin), 0.0)  # (S, B, H, Sq)
    weight = np.moveaxis(weight, 2, 3)[..., None]         # (S, B, Sq, H, 1)
    live_o = np.moveaxis(live, 2, 3)[..., None]
    bad_o = live_o & ~np.isfinite(out_p)
    contrib = np.where(live_o & ~bad_o, out_p, 0.0) * weight
    out = np.sum(contrib, axis=0)
    row_nan = lse_nan.any(axis=0)                         # (B, H, Sq)
    out_nan = np.moveaxis(row_nan, 1, 2) | bad_o.any(axis=(0, 4))   # (B, Sq, H)
    out[out_nan] = np.nan
    lse[row_nan] = np.nan
    return out, lse


# ---------------------------------------------------------------------------
# KV cache (flash_attn_with_kvcache): rotary, append, paged KV, per-row lengths
# ---------------------------------------------------------------------------

def apply_rotary(x, cos, sin, positions, interleaved=True):
    """Rotary embedding of ``x`` at the given positions (flash-attn's definition), float64.

    ``x``: (batch, seqlen, nheads, headdim); ``cos``, ``sin``: (seqlen_ro,
    rotary_dim / 2); ``positions``: int (batch, seqlen), the row of cos / sin
    each token takes. The first ``rotary_dim`` features rotate, the rest pass
    through. ``interleaved=True`` (GPT-J): pairs ``(x[2i], x[2i + 1])``;
    ``False`` (GPT-NeoX): pairs ``(x[i], x[i + rotary_dim / 2])``. Each pair
    ``(a, b)`` becomes ``(a cos - b sin, a sin + b cos)`` with angle row
    ``positions[b, t]`` and frequency ``i``.
    """
    x = np.asarray(x, dtype=np.float64)
    cos = np.asarray(cos, dtype=np.float64)
    sin = np.asarray(sin, dtype=np.float64)
    positions = np.asarray(positions)
    if x.ndim != 4:
        raise ValueError(f"x must be a 4-D array (batch, seqlen, nheads, headdim), got shape {x.shape}")
    if cos.ndim != 2 or sin.shape != cos.shape:
        raise ValueError(
            f"rotary_cos and rotary_sin must be 2-D arrays of one shape (seqlen_ro, "
            f"rotary_dim / 2), got {cos.shape} and {sin.shape}")
    half = cos.shape[1]
    rot = 2 * half
    if rot > x.shape[-1]:
        raise ValueError(
            f"rotary_dim = 2 * rotary_cos.shape[1] = {rot} must be <= headdim {x.shape[-1]}")
    if positions.shape != x.shape[:2] or positions.dtype.kind not in "iu":
        raise ValueError(
            f"positions must be an int array of shape (batch, seqlen) = {x.shape[:2]}, "
            f"got {positions.dtype} {positions.shape}")
    if positions.size and (positions.min() < 0 or positions.max() >= cos.shape[0]):
        raise ValueError(
            f"rotary positions must lie in [0, seqlen_ro = {cos.shape[0]}), got "
            f"{positions.min()} .. {positions.max()}: rotary_cos / rotary_sin are too short")
    c = cos[positions][:, :, None, :]            # (B, S, 1, half)
    s = sin[positions][:, :, None, :]
    out = x.copy()
    if interleaved:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2] = a * c - b * s
        out[..., 1:rot:2] = a * s + b * c
    else:
        a, b = x[..., :half], x[..., half:rot]
        out[..., :half] = a * c - b * s
        out[..., half:rot] = a * s + b * c
    return out


def _int_vector(name, x, length, what):
    """``x`` as an int64 (length,) array, else ValueError naming it."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu" or arr.shape != (length,):
        raise ValueError(
            f"{name} must be an int array of shape ({length},) {what}, got "
            f"dtype {arr.dtype} and shape {arr.shape}")
    return arr.astype(np.int64)


class _CacheLayout:
    """Where logical key ``p`` of batch row ``b`` lives in a (possibly paged) cache.

    Contiguous: row ``cache_batch_idx[b]`` (default ``b``), index ``p``.
    Paged: block ``block_table[b, p // page]``, offset ``p % page``. ``capacity``:
    the logical length of a row (``seqlen_cache`` or ``max_blocks * page``).
    """

    def __init__(self, k_cache, batch, cache_batch_idx, block_table):
        self.paged = block_table is not None
        if self.paged:
            if cache_batch_idx is not None:
                raise ValueError(
                    "cache_batch_idx and block_table can't be used together (a paged KV "
                    "cache addresses each batch row through block_table)")
            table = np.asarray(block_table)
            if table.dtype.kind not in "iu" or table.ndim != 2 or table.shape[0] != batch:
                raise ValueError(
                    f"block_table must be an int array (batch, max_num_blocks_per_seq) with "
                    f"batch = {batch}, got dtype {table.dtype} and shape {table.shape}")
            self.table = table.astype(np.int64)
            self.page = k_cache.shape[1]
            self.num_blocks = k_cache.shape[0]
            self.capacity = self.table.shape[1] * self.page
        else:
            self.capacity = k_cache.shape[1]
            if cache_batch_idx is None:
                if k_cache.shape[0] < batch:
                    raise ValueError(
                        f"k_cache holds {k_cache.shape[0]} batch rows, fewer than q's batch "
                        f"{batch} (pass cache_batch_idx to pick rows)")
                self.rows = np.arange(batch, dtype=np.int64)
            else:
                self.rows = _int_vector("cache_batch_idx", cache_batch_idx, batch, "(batch,)")
                if self.rows.size and (self.rows.min() < 0 or self.rows.max() >= k_cache.shape[0]):
                    raise ValueError(
                        f"cache_batch_idx must index k_cache's {k_cache.shape[0]} rows, got "
                        f"{self.rows.tolist()}")

    def index(self, b, p):
        """(first-axis indices, second-axis indices) of logical keys ``p`` of row ``b``."""
        p = np.asarray(p, dtype=np.int64)
        if not self.paged:
            return np.full(p.shape, self.rows[b]), p
        blocks = self.table[b, p // self.page]
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise ValueError(
                f"block_table[{b}] must index the {self.num_blocks} blocks of k_cache for the "
                f"positions it uses, got blocks {np.unique(blocks).tolist()}")
        return blocks, p % self.page


def _normalize_kvcache_window(window_size, causal, seqlen_q, capacity, alibi):
    """flash-attn's mha_fwd_kvcache rules: (causal, (left, right))."""
    left, right = _resolve_window(window_size, False)
    causal = bool(causal)
    if seqlen_q == 1 and not alibi:
        causal = False          # one query row: causal is no mask at all
    if causal:
        right = 0
    if left >= capacity:
        left = -1
    if right >= capacity:
        right = -1
    return causal, (left, right)


@_ignore_underflow
def attention_kvcache(q, k_cache, v_cache, cache_seqlens=None, k=None, v=None, *,
                      rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                      cache_batch_idx=None, cache_leftpad=None, block_table=None,
                      softmax_scale=None, causal=False, window_size=(-1, -1),
                      softcap=0.0, alibi_slopes=None, num_splits=1, rounding=None):
    """The math of flash-attn's ``flash_attn_with_kvcache``, float64.

    Steps, per batch row ``b`` (flash-attn 2.8's kernel):

    1. Lengths: ``start = cache_leftpad[b]`` (default 0), ``end =
       cache_seqlens[b]`` (default: the capacity, below). The row's cache is
       logical keys ``start .. end - 1``.
    2. Append (``k``, ``v`` given): new token ``t`` is written at logical
       position ``end + t`` (``k`` rotated first when ``rotary_cos`` is
       given); the caches returned are updated copies (the inputs are not
       changed). The row's keys are then ``start .. end + seqlen_new - 1``.
    3. Rotary (needs ``k``): ``k[b, t]`` uses cos / sin row ``end + t``;
       ``q[b, i]`` uses row ``end + i`` if the call is causal or local
       (after the normalization below), else row ``end`` for every ``i``.
       Positions are absolute cache indices (``cache_leftpad`` is not
       subtracted), as in flash-attn.
    4. Attention of ``q[b]`` over the row's ``Sk_b = end + seqlen_new -
       start`` keys, key ``j`` being logical position ``start + j``: causal,
       window, softcap and ALiBi exactly as :func:`attention_naive` with
       ``seqlen_k = Sk_b`` (bottom-right aligned per row). ``Sk_b = 0`` gives
       ``O = 0`` and ``LSE = +inf``. With ``num_splits > 1`` it is computed
       by :func:`attention_splitkv_partials` + :func:`combine_splits` over
       the row's keys (the same result to float64 rounding).

    Window normalization (flash-attn's C++ entry): with ``seqlen_q == 1``
    and no ALiBi, causal is dropped (no mask with one query row);
    ``causal`` sets ``right = 0``; a bound ``>= capacity`` becomes -1.

    Layouts: contiguous ``k_cache``, ``v_cache`` (batch_cache, seqlen_cache,
    nheads_kv, headdim): row ``b`` reads cache row ``cache_batch_idx[b]``
    (default ``b``), capacity ``seqlen_cache``. Paged (``block_table`` int
    (batch, max_num_blocks_per_seq)): caches (num_blocks, page_block_size,
    nheads_kv, headdim), logical position ``p`` of row ``b`` is block
    ``block_table[b, p // page_block_size]``, offset ``p % page_block_size``;
    capacity ``max_num_blocks_per_seq * page_block_size``; only the table
    entries of positions in use are read (others may hold anything).
    ``cache_batch_idx`` and ``block_table`` exclude each other. Pages (or cache
    rows) may be shared between batch rows for reading; a slot that one row
    appends to and another row writes or reads raises ValueError (a kernel
    appending and reading in one pass leaves it undefined).

    Parameters
    ----------
    q : array (batch, seqlen_q, nheads, headdim)
    k_cache, v_cache : arrays, layouts above
    cache_seqlens : int or int array (batch,), optional
    k, v : arrays (batch, seqlen_new, nheads_kv, headdim), optional (both or neither)
    rotary_cos, rotary_sin : arrays (seqlen_ro, rotary_dim / 2), optional
        ``rotary_dim`` even and ``<= headdim``; need ``k``.
    rotary_interleaved : bool
    cache_batch_idx, cache_leftpad : int arrays (batch,), optional
        ``0 <= cache_leftpad[b] <= cache_seqlens[b]``.
    block_table : int array (batch, max_num_blocks_per_seq), optional
    softmax_scale, causal, window_size, softcap, alibi_slopes :
        As for :func:`attention_naive` (per row, see 4).
    num_splits : int >= 0 (0 and 1: no split)
    rounding : callable, optional
        Applied (float64 array -> float64 array) to the rotated ``q`` and the
        rotated ``k`` before they are used and written: a kernel working in
        fp16 / bf16 stores the rotated ``k`` in the cache's dtype and attends
        to the rotated ``q`` in ``q``'s dtype (``cuflash.decode`` passes the
        rounding to the inputs' dtype). Without rotary it is not called.

    Returns
    -------
    out : float64 (batch, seqlen_q, nheads, headdim)
    lse : float64 (batch, nheads, seqlen_q) (``+inf`` for rows without keys)
    k_cache_new, v_cache_new : float64 copies of the caches, ``k`` (rotated)
        and ``v`` written in (the inputs themselves when nothing is appended,
        as float64 copies)
    """
    q = np.asarray(q)
    k_cache = np.asarray(k_cache)
    v_cache = np.asarray(v_cache)
    if q.ndim != 4:
        raise ValueError(f"q must be a 4-D array (batch, seqlen_q, nheads, headdim), got shape {q.shape}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must be a 4-D array (batch_cache, seqlen_cache, nheads_kv, headdim) "
                f"or (num_blocks, page_block_size, nheads_kv, headdim), got shape {x.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {k_cache.shape}, got {v_cache.shape}")
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_kv = k_cache.shape[2]
    if k_cache.shape[3] != headdim:
        raise ValueError(f"k_cache's headdim ({k_cache.shape[3]}) must equal q's ({headdim})")
    if nheads_kv < 1 or nheads % nheads_kv:
        raise ValueError(
            f"nheads of q ({nheads}) must be a positive multiple of nheads_kv of k_cache ({nheads_kv})")
    if isinstance(num_splits, (bool, np.bool_)) or int(num_splits) != num_splits or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    num_splits = max(int(num_splits), 1)
    layout = _CacheLayout(k_cache, batch, cache_batch_idx, block_table)
    capacity = layout.capacity

    if cache_seqlens is None:
        ends = np.full(batch, capacity, dtype=np.int64)
    elif np.ndim(cache_seqlens) == 0:
        if isinstance(cache_seqlens, (bool, np.bool_)) or np.asarray(cache_seqlens).dtype.kind not in "iu":
            raise ValueError(f"cache_seqlens must be an int or an int array (batch,), got {cache_seqlens!r}")
        ends = np.full(batch, int(cache_seqlens), dtype=np.int64)
    else:
        ends = _int_vector("cache_seqlens", cache_seqlens, batch, "(batch,)")
    starts = (np.zeros(batch, dtype=np.int64) if cache_leftpad is None
              else _int_vector("cache_leftpad", cache_leftpad, batch, "(batch,)"))

    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append) or both be None")
    seqlen_new = 0
    if k is not None:
        if cache_seqlens is None:
            raise ValueError("cache_seqlens must be given with k and v (where to append them)")
        k = np.asarray(k, dtype=np.float64)
        v = np.asarray(v, dtype=np.float64)
        if k.ndim != 4 or k.shape[0] != batch or k.shape[2:] != (nheads_kv, headdim):
            raise ValueError(
                f"k must have shape (batch, seqlen_new, nheads_kv, headdim) = ({batch}, "
                f"seqlen_new, {nheads_kv}, {headdim}), got {k.shape}")
        if v.shape != k.shape:
            raise ValueError(f"v must have k's shape {k.shape}, got {v.shape}")
        seqlen_new = k.shape[1]
    if (ends < 0).any() or (ends + seqlen_new > capacity).any():
        raise ValueError(
            f"cache_seqlens must lie in [0, capacity - seqlen_new] = [0, {capacity - seqlen_new}] "
            f"(capacity {capacity}, {seqlen_new} new tokens), got {ends.tolist()}")
    if (starts < 0).any() or (starts > ends).any():
        raise ValueError(
            f"cache_leftpad must lie in [0, cache_seqlens[b]] per row, got {starts.tolist()} "
            f"for cache_seqlens {ends.tolist()}")
    slopes = _check_alibi(alibi_slopes, batch, nheads)
    softcap = _check_softcap(softcap)
    causal, window = _normalize_kvcache_window(window_size, causal, seqlen_q, capacity,
                                               slopes is not None)
    local = window != (-1, -1) and not causal

    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("rotary_cos and rotary_sin must be given together")
        if k is None:
            raise ValueError("rotary_cos / rotary_sin need k and v (rotary applies to the new keys)")
        cos = np.asarray(rotary_cos, dtype=np.float64)
        sin = np.asarray(rotary_sin, dtype=np.float64)
        k = apply_rotary(k, cos, sin, ends[:, None] + np.arange(seqlen_new)[None, :],
                         rotary_interleaved)
        qpos = ends[:, None] + (np.arange(seqlen_q)[None, :] if causal or local
                                else np.zeros((1, seqlen_q), dtype=np.int64))
        q = apply_rotary(q, cos, sin, qpos, rotary_interleaved)
        if rounding is not None:
            q, k = rounding(q), rounding(k)
    q = np.asarray(q, dtype=np.float64)

    k_new = np.array(k_cache, dtype=np.float64)
    v_new = np.array(v_cache, dtype=np.float64)
    if seqlen_new:
        # A kernel appends and reads in one pass: a slot that one batch row writes and another
        # row writes or reads (duplicate cache_batch_idx, shared pages) has no defined value.
        writer = {}
        for b in range(batch):
            i0, i1 = layout.index(b, ends[b] + np.arange(seqlen_new))
            for slot in zip(i0.tolist(), i1.tolist()):
                if writer.setdefault(slot, b) != b:
                    raise ValueError(
                        f"cache_batch_idx / block_table make batch rows {writer[slot]} and {b} "
                        "append to the same cache slot; the result would be ambiguous")
            k_new[i0, i1] = k[b]
            v_new[i0, i1] = v[b]
        for b in range(batch):
            i0, i1 = layout.index(b, np.arange(starts[b], ends[b] + seqlen_new))
            for slot in zip(i0.tolist(), i1.tolist()):
                if writer.get(slot, b) != b:
                    raise ValueError(
                        f"cache_batch_idx / block_table make batch row {b} read a cache slot that "
                        f"row {writer[slot]} appends to; the result would be ambiguous")

    out = np.zeros((batch, seqlen_q, nheads, headdim))
    lse = np.full((batch, nheads, seqlen_q), np.inf)
    for b in range(batch):
        i0, i1 = layout.index(b, np.arange(starts[b], ends[b] + seqlen_new))
        kb, vb = k_new[i0, i1][None], v_new[i0, i1][None]
        kw = dict(window_size=window, softcap=softcap,
                  alibi_slopes=None if slopes is None else slopes[b])
        if num_splits > 1:
            o, l = combine_splits(*attention_splitkv_partials(
                q[b:b + 1], kb, vb, num_splits, softmax_scale, causal, **kw))
        else:
            o, l = attention_naive(q[b:b + 1], kb, vb, softmax_scale, causal, True, **kw)
        out[b], lse[b] = o[0], l[0]
    return out, lse, k_new, v_new
