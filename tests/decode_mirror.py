"""A NumPy mirror of kernels_cu/decode_splitkv.cu's index math, float64: the split of each row's K/V
blocks, the visible key ranges of a CTA's packed query rows (GQA packing, causal / window,
leftpad), which blocks take the element-wise mask, softcap and ALiBi in raw-score units, the
per-warp online softmax over each warp's keys of a block, the warps' merge and the LSE combine.
tests/test_decode_cpu.py holds it to the reference; a change of the kernel's logic changes it here
too (the GPU tests then check the kernel itself)."""
import math

import numpy as np


def kernel_mirror(q, kc, vc, ends, starts, seqlen_new, scale, causal_window, softcap, slopes,
                  num_splits, warps=4, warp_n=16, m_tiles=1):
    batch, sq, h, d = q.shape
    hk = kc.shape[2]
    group = h // hk
    rows_cta = 16 * m_tiles
    row_blocks = max(1, -(-group * sq // rows_cta))
    block_n = warps * warp_n
    left, right = causal_window
    out = np.full((batch, sq, h, d), np.nan)
    lse = np.full((batch, h, sq), np.nan)
    rows_all = batch * h * sq
    o_part = np.full((num_splits, rows_all, d), np.nan)
    l_part = np.full((num_splits, rows_all), np.nan)
    for b in range(batch):
        end, start = ends[b], starts[b]
        keys = end + seqlen_new - start
        offset = keys - sq
        for hkv in range(hk):
            for rb in range(row_blocks):
                r0 = rb * rows_cta
                rows_valid = min(rows_cta, group * sq - r0)
                qi_lo, qi_hi = r0 // group, (r0 + rows_valid - 1) // group
                key_lo, key_hi, full_lo, full_hi = 0, keys, 0, keys
                if left >= 0:
                    key_lo = max(0, qi_lo + offset - left); full_lo = max(0, qi_hi + offset - left)
                if right >= 0:
                    key_hi = min(keys, qi_hi + offset + right + 1); full_hi = min(keys, qi_lo + offset + right + 1)
                n_blocks_row = -(-keys // block_n)
                per_split = -(-n_blocks_row // num_splits)
                for split in range(num_splits):
                    n_begin = max(split * per_split, key_lo // block_n)
                    n_end = min(min(n_blocks_row, (split + 1) * per_split),
                                0 if key_hi <= 0 else -(-key_hi // block_n))
                    # rows of the tile
                    prs = np.arange(r0, r0 + rows_cta)
                    qis = prs // group
                    heads = np.minimum(hkv * group + prs % group, h - 1)
                    Q = np.zeros((rows_cta, d))
                    for r in range(rows_valid):
                        Q[r] = q[b, qis[r], heads[r]]
                    row_lo = qis + offset - left if left >= 0 else np.zeros(rows_cta, int)
                    row_hi = np.minimum(keys, qis + offset + right + 1) if right >= 0 else np.full(rows_cta, keys)
                    slope = slopes[b, heads] / scale if slopes is not None else np.zeros(rows_cta)
                    M = np.full((warps, rows_cta), -np.inf); L = np.zeros((warps, rows_cta))
                    O = np.zeros((warps, rows_cta, d))
                    for n in range(n_end - 1, n_begin - 1, -1):
                        for w in range(warps):
                            key0 = n * block_n + w * warp_n
                            ks = key0 + np.arange(warp_n)
                            K = np.zeros((warp_n, d)); V = np.zeros((warp_n, d))
                            for i, j in enumerate(ks):
                                if j < keys:
                                    K[i] = kc[b, start + j, hkv]; V[i] = vc[b, start + j, hkv]
                            S = Q @ K.T
                            if softcap > 0 or slopes is not None:
                                x = S * scale
                                if softcap > 0:
                                    x = softcap * np.tanh(x / softcap)
                                S = x / scale - slope[:, None] * np.abs(qis[:, None] + offset - ks[None, :])
                            if n * block_n < full_lo or (n + 1) * block_n > full_hi:
                                hide = (ks[None, :] < row_lo[:, None]) | (ks[None, :] >= row_hi[:, None])
                                S = np.where(hide, -np.inf, S)
                            m_new = np.maximum(M[w], S.max(1))
                            ms = np.where(m_new == -np.inf, 0, m_new * scale)
                            with np.errstate(invalid="ignore"):
                                alpha = np.exp(M[w] * scale - ms)
                            P = np.exp(S * scale - ms[:, None])
                            L[w] = L[w] * alpha + P.sum(1)
                            O[w] = O[w] * alpha[:, None] + P @ V
                            M[w] = m_new
                    m_row = M.max(0)
                    msc = np.where(m_row == -np.inf, 0, m_row * scale)
                    wt = np.exp(M * scale - msc[None, :])
                    l_row = (wt * L).sum(0)
                    o_row = (wt[:, :, None] * O).sum(0)
                    inv = np.where(l_row > 0, 1 / np.where(l_row > 0, l_row, 1), 0)
                    for r in range(rows_valid):
                        qi, hh = qis[r], heads[r]
                        rid = (b * h + hh) * sq + qi
                        if num_splits == 1:
                            out[b, qi, hh] = o_row[r] * inv[r]
                            lse[b, hh, qi] = np.inf if l_row[r] == 0 else m_row[r] * scale + math.log(l_row[r])
                        else:
                            o_part[split, rid] = o_row[r] * inv[r]
                            l_part[split, rid] = -np.inf if l_row[r] == 0 else m_row[r] * scale + math.log(l_row[r])
    if num_splits > 1:
        for rid in range(rows_all):
            qi = rid % sq; hh = (rid // sq) % h; b = rid // (sq * h)
            mx = l_part[:, rid].max()
            if mx == -np.inf:
                out[b, qi, hh] = 0; lse[b, hh, qi] = np.inf; continue
            s = np.exp(l_part[:, rid] - mx).sum()
            L_ = mx + math.log(s)
            lse[b, hh, qi] = L_
            acc = np.zeros(d)
            for sp in range(num_splits):
                if l_part[sp, rid] == -np.inf: continue
                acc += np.exp(l_part[sp, rid] - L_) * o_part[sp, rid]
            out[b, qi, hh] = acc
    return out, lse
