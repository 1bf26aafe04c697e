// mask.cuh: which keys each query sees, as compile-time mask kinds, applied to S (or Sᵀ) in
// the mma accumulator layout.
//
// A mask kind is a small struct built once per CTA from the problem sizes. It answers three
// questions, coarse to fine, so that a kernel pays for per-element work only where needed:
//   1. block range   which K/V blocks a Q block visits (forward: kv_block_end) and which Q
//                    blocks visit a K/V block (backward: q_block_begin); blocks outside the
//                    range are skipped entirely
//   2. needs_mask    whether a (Q block, K/V block) pair hides any element: the KV loop runs
//                    the element-wise mask on those few blocks only, the bulk runs without it
//   3. apply         per element: sets the hidden elements of an S tile (or one element) to a
//                    fill value (-inf before the softmax, 0 for a recomputed P)
// A kernel names its kind once (`using Mask = CausalMask<kCausal>;`). Further kinds (sliding
// window, block-sparse, an arbitrary mask read from memory) are further structs with the same
// members: the kernels only call these.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// Bottom-right-aligned causal mask (kCausal) and the ragged key end (always): query i sees
// key j iff j < seqlen_k and, if kCausal, j <= i + seqlen_k - seqlen_q. With seqlen_q >
// seqlen_k the first seqlen_q - seqlen_k queries see no key at all (O = 0, LSE = +inf).
template <bool kCausal>
struct CausalMask {
    int seqlen_k;
    int causal_offset;  // seqlen_k - seqlen_q: query i's last visible key is i + causal_offset

    __device__ __forceinline__ CausalMask(int seqlen_q, int seqlen_k_)
        : seqlen_k(seqlen_k_), causal_offset(seqlen_k_ - seqlen_q) {}

    // K/V blocks of kBc keys seen by the queries [row0, row0 + kBr): blocks [0, result). Under
    // the causal mask the last query's last visible key ends the range; 0 when it is < 0.
    template <int kBr, int kBc>
    __device__ __forceinline__ int kv_block_end(int row0) const {
        int n_blocks = (seqlen_k + kBc - 1) / kBc;
        if (kCausal) {
            const int last_key = row0 + kBr - 1 + causal_offset;
            n_blocks = last_key < 0 ? 0 : min(n_blocks, last_key / kBc + 1);
        }
        return n_blocks;
    }

    // First Q block of kBr queries that sees any of the keys from key0 on; every later Q block
    // does too. Under the causal mask: the block of the first query i with
    // key0 <= i + causal_offset.
    template <int kBr>
    __device__ __forceinline__ int q_block_begin(int key0) const {
        return kCausal ? max(0, (key0 - causal_offset) / kBr) : 0;
    }

    // Whether the block of queries from row0 on and the K/V block n_block (keys n_block·kBc
    // up to (n_block + 1)·kBc - 1) hides any element: keys past seqlen_k (the ragged last
    // block), or a last key beyond the first query's diagonal (the causal diagonal blocks).
    // Every other block is the unmasked bulk.
    template <int kBc>
    __device__ __forceinline__ bool needs_mask(int row0, int n_block) const {
        const bool ragged = (n_block + 1) * kBc > seqlen_k;
        const bool diagonal = kCausal && (n_block + 1) * kBc - 1 > row0 + causal_offset;
        return ragged || diagonal;
    }

    // One element: x = fill if `key` is hidden from `query`. Sᵀ in the backward (rows are keys)
    // is masked this way, element by element as P is recomputed.
    __device__ __forceinline__ void apply(float& x, int query, int key, float fill) const {
        if (key >= seqlen_k || (kCausal && key > query + causal_offset)) x = fill;
    }

    // A tile of S (rows are queries, columns keys) in the mma C layout (ptx.cuh): element e of
    // tile (mt, nt) is query query0 + 16·mt + g + 8·(e / 2), key key0 + 8·nt + 2t + e % 2.
    // The same rule as above, as one end per row: the keys visible to query i are
    // [0, min(seqlen_k, i + causal_offset + 1)), so each element costs one compare.
    template <int kMT, int kNT>
    __device__ __forceinline__ void apply(float (&acc)[kMT][kNT][4], int query0, int key0, int g, int t,
                                          float fill) const {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int query = query0 + mt * 16 + g + 8 * half;
                const int key_end = kCausal ? min(seqlen_k, query + causal_offset + 1) : seqlen_k;
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (key0 + nt * 8 + 2 * t + e >= key_end) acc[mt][nt][2 * half + e] = fill;
            }
    }
};

// Bottom-right-aligned band (sliding window, kWindow) and causal mask: query i sees key j iff
// j < seqlen_k and
//   i + offset - left <= j <= i + offset + right,      offset = seqlen_k - seqlen_q,
// where a bound of -1 is unbounded (flash-attn's window_size = (left, right)) and kCausal
// forces right = 0. Without kWindow it is CausalMask<kCausal> exactly (left = right = -1).
// Blocks are skipped on both sides of the band, so the work is proportional to its width:
// the forward visits K/V blocks [kv_block_begin, kv_block_end) of a Q block, the backward Q
// blocks [q_block_begin, q_block_end) of a K/V block. A row with no visible key at all gives
// O = 0 and LSE = +inf as under CausalMask.
template <bool kCausal, bool kWindow>
struct BandMask {
    int seqlen_k;
    int causal_offset;  // seqlen_k - seqlen_q (the name CausalMask uses)
    int left;           // keys before the diagonal a query sees; -1: all (kWindow only)
    int right;          // keys after the diagonal a query sees; -1: all (0 under kCausal)

    __device__ __forceinline__ BandMask(int seqlen_q, int seqlen_k_, int window_left, int window_right)
        : seqlen_k(seqlen_k_), causal_offset(seqlen_k_ - seqlen_q),
          left(kWindow ? window_left : -1), right(kCausal ? 0 : kWindow ? window_right : -1) {}

    __device__ __forceinline__ bool has_left() const { return kWindow && left >= 0; }
    __device__ __forceinline__ bool has_right() const { return kCausal || (kWindow && right >= 0); }

    // K/V blocks of kBc keys seen by the queries [row0, row0 + kBr): [kv_block_begin,
    // kv_block_end); empty when begin >= end. The first query's first visible key starts the
    // range, the last query's last visible key ends it.
    template <int kBr, int kBc>
    __device__ __forceinline__ int kv_block_end(int row0) const {
        int n_blocks = (seqlen_k + kBc - 1) / kBc;
        if (has_right()) {
            const int last_key = row0 + kBr - 1 + causal_offset + right;
            n_blocks = last_key < 0 ? 0 : min(n_blocks, last_key / kBc + 1);
        }
        return n_blocks;
    }
    template <int kBr, int kBc>
    __device__ __forceinline__ int kv_block_begin(int row0) const {
        return has_left() ? max(0, row0 + causal_offset - left) / kBc : 0;
    }

    // Q blocks of kBr queries that see any key of [key0, key0 + kBc): [q_block_begin,
    // q_block_end) (m_blocks: the number of Q blocks). The first query i with key0 <= i +
    // offset + right begins it, the last one with key0 + kBc - 1 >= i + offset - left ends it.
    template <int kBr>
    __device__ __forceinline__ int q_block_begin(int key0) const {
        return has_right() ? max(0, (key0 - causal_offset - right) / kBr) : 0;
    }
    template <int kBr, int kBc>
    __device__ __forceinline__ int q_block_end(int key0, int m_blocks) const {
        if (!has_left()) return m_blocks;
        const int last_query = key0 + kBc - 1 - causal_offset + left;
        return last_query < 0 ? 0 : min(m_blocks, last_query / kBr + 1);
    }

    // Whether the queries [row0, row0 + kBr) and the K/V block n_block hide any element: the
    // ragged last block, a last key past the first query's right bound, or a first key before
    // the last query's left bound. Every other block is the unmasked bulk.
    template <int kBc, int kBr>
    __device__ __forceinline__ bool needs_mask(int row0, int n_block) const {
        const int key0 = n_block * kBc;
        const bool ragged = key0 + kBc > seqlen_k;
        const bool right_edge = has_right() && key0 + kBc - 1 > row0 + causal_offset + right;
        const bool left_edge = has_left() && key0 < row0 + kBr - 1 + causal_offset - left;
        return ragged || right_edge || left_edge;
    }

    // One element: x = fill if `key` is hidden from `query` (Sᵀ in the backward).
    __device__ __forceinline__ void apply(float& x, int query, int key, float fill) const {
        const int diag = query + causal_offset;
        if (key >= seqlen_k || (has_right() && key > diag + right) || (has_left() && key < diag - left))
            x = fill;
    }

    // A tile of S in the mma C layout (as CausalMask::apply): per row the visible keys are
    // [key_begin, key_end), two compares per element.
    template <int kMT, int kNT>
    __device__ __forceinline__ void apply(float (&acc)[kMT][kNT][4], int query0, int key0, int g, int t,
                                          float fill) const {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int diag = query0 + mt * 16 + g + 8 * half + causal_offset;
                const int key_end = has_right() ? min(seqlen_k, diag + right + 1) : seqlen_k;
                const int key_begin = has_left() ? diag - left : 0;
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = key0 + nt * 8 + 2 * t + e;
                        if (key >= key_end || (has_left() && key < key_begin)) acc[mt][nt][2 * half + e] = fill;
                    }
            }
    }
};

}  // namespace cuflash
