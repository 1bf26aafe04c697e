// softmax_fold.cuh: sm90_fwd's softmax variants for calls with features (kLazyRescale, kFoldCap),
// built from softmax.cuh's pieces; a kernel without those flags includes this file and uses none
// of it. A separate file so that the families that include softmax.cuh and score.cuh (fa2_fwd,
// fa2_bwd, sm90_bwd: their code hashes stamp the tuned tables) keep their source.
//
// Lazy rescaling (FlashAttention-4's, kLazyRescale): the running max m moves only when a block's
// max exceeds it by more than kLazyRescaleLog2 in exp2 units (scale·log2(e) times the scores'
// difference). P is then at most 2^kLazyRescaleLog2 = 256 (16-bit P, fp32 l and O have the range)
// and a block that does not move m leaves O alone: no O *= alpha (head_dim / 2 multiplies per
// thread and block, on the path between the P V GEMM's completion and the next GEMMs). The result
// is the same softmax: m only offsets the exponents, l and O share it, and the LSE is
// m·scale + log l with the m that was used.
//
// Folded softcap (kFoldCap): the forward keeps the score in units of softcap_out, i.e. the tanh
// itself t = tanh(S·softcap_in) (ALiBi's bias divided by softcap_out), and the softmax takes
// scale_log2·softcap_out = softcap·log2(e): the product softcap_out·t is never formed (one
// multiply per element fewer). The LSE's scale is softmax_scale·softcap_out = softcap. And since
// tanh is increasing, the row max of t is tanh of the row max of S: without ALiBi the max runs on
// the raw S, independent of the tanhs (the ALU's FMNMX next to the SFU's tanh.approx instead of
// after it).
//
// Software exp2 with the folded softcap (kEmu: sm90_fwd's kEmuExp2 with kFoldCap): a softcapped
// score takes two SFU ops (tanh.approx, ex2.approx); at head dim 128 those alone take as long as
// the score's share of the two GEMMs (2 ops at 16 per SM clock against 512 FLOPs at ~4096), where
// the folded step issues about as many instructions per score as the plain one. kEmu of every
// four 8-column tiles of P take exp2_emu.cuh's polynomial on the FMA / ALU pipes instead.
#pragma once
#include "ptx.cuh"
#include "tile.cuh"
#include "softmax.cuh"
#include "score.cuh"
#include "ptx_sm90_store.cuh"
#include "exp2_emu.cuh"

namespace cuflash {

constexpr float kLazyRescaleLog2 = 8.f;

// A compile-time bool as a value (a generic lambda's argument picks its copy: sm90_fwd's kMaskedCopy)
template <bool kValue> struct BoolTag { static constexpr bool value = kValue; };

// The row max of one block of S, quad-reduced: mx[mt][half] of row 16·mt + g + 8·half (-inf where
// every element is -inf): softmax_step's first half.
template <int kMT, int kNTS>
__device__ __forceinline__ void softmax_rowmax(const float (&s)[kMT][kNTS][4], float (&mx)[kMT][2]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float x = neg_inf();
#pragma unroll
            for (int nt = 0; nt < kNTS; ++nt)
                x = fmaxf(x, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
            mx[mt][half] = quad_max(x);
        }
}

// Where O's normalization must sum the P that the P V GEMM takes (sm90_fwd kFoldCap 3, 4 with the
// fixed running max m = 1, t's bound): no P = exp2(k (t - 1)) is then exactly 1, and each one goes
// to the GEMM rounded to 16 bits, so O = Σ P̃_j V_j / Σ P_j is off a convex combination of V's
// rows by P's rounding (2^-9 relative in bf16): at seqlen_k = 1, O = V (1 + δ) and the backward's
// dQ = dS K with dS = P (dO·V - dO·O) != 0. O / Σ P̃_j is a convex combination by construction
// (O = V at one key), while the LSE keeps log Σ P_j (the backward recomputes the unrounded P from
// it). sm90_fwd sums Σ P̃_j on the tensor cores (kRowSumMma, ptx_sm90_rowsum.cuh: P̃ times a block
// of ones beside O += P̃ V); this is the CUDA-core form, kept for timing (tests/softcap_fixed_timing.py
// "addsum": 2.4 instructions more per score, SASS of the d128 tiles, nvcc 13.0).
// add_rounded<RoundTo>(sum, x0, x1): sum += x0 + x1 as RoundTo (bf16 / fp16) holds them, one
// cvt pair and two widenings; RoundTo void: nothing (RoundedSum<void>::kOn false).
template <class RoundTo> struct RoundedSum { static constexpr bool kOn = true; };
template <> struct RoundedSum<void> { static constexpr bool kOn = false; };
// RoundTo for a compile-time choice: Elem where kOn, else void (no rounded sum)
template <bool kOn, class Elem> struct RoundToIf { using type = Elem; };
template <class Elem> struct RoundToIf<false, Elem> { using type = void; };

template <class RoundTo>
__device__ __forceinline__ void add_rounded(float& sum, float x0, float x1) {
    if constexpr (RoundedSum<RoundTo>::kOn) {
        const u32 w = pack2<RoundTo>(x0, x1);
        sum += to_float<RoundTo>(u16(w)) + to_float<RoundTo>(u16(w >> 16));
    }
}

// softmax_step's second half, with the block's row max given (mx, quad-reduced, in the units of
// s). kLazy: m moves only by more than kLazyRescaleLog2 (header); `rescale` says whether any of
// this thread's rows moved (alpha != 1), i.e. whether O needs softmax_rescale. Without kLazy it
// is softmax_step's arithmetic, rescale always true.
// One row of softmax_step_max / softmax_step_shift once the row's new maximum m_new (max of m and
// the block's row max, quad-reduced) is known: kLazy's move decision, alpha, m, and the row of s
// turned into P in place with l gaining its sum. kShift: the row's scores are s + shift (the
// exponent's offset takes -shift·scale_log2); without it the offset is m's alone.
// kEmu, kDegree: exp2_emulated<kEmu>'s tiles take exp2_poly<kDegree> (header); kEmu 0, every exp2
// on the SFU.
// RoundTo (bf16 / fp16; void: none): lr also gains the row's P as the P V GEMM takes them, rounded to
// that type (two fp32 sums then: l for the LSE, lr for O's normalization; header of add_rounded).
template <bool kLazy, bool kShift, int kEmu = 0, int kDegree = 3, class RoundTo = void, int kMT, int kNTS>
__device__ __forceinline__ void softmax_row_update(float (&s)[kMT][kNTS][4], int mt, int half, float m_new,
                                                   float shift, float& m, float& l, float& lr, float scale_log2,
                                                   float& alpha, bool& rescale) {
    bool move = true;
    if constexpr (kLazy) {
        // a row's first visible block always moves m (from -inf: the difference is +inf);
        // a row masked so far (-inf - -inf = NaN, which fails the compare) keeps m = -inf
        move = (m_new - m) * scale_log2 > kLazyRescaleLog2;
        m_new = move ? m_new : m;
        rescale |= move;
    }
    // as softmax_step: a row masked so far uses 0 as the offset (no -inf - (-inf))
    const float m_scaled = m_new == neg_inf() ? 0.f : m_new * scale_log2;
    // a row whose m did not move keeps O and l as they are: alpha exactly 1
    alpha = move ? exp2_approx(m * scale_log2 - m_scaled) : 1.f;
    m = m_new;
    float offset_log2 = m_scaled;
    if constexpr (kShift)
        offset_log2 = fmaf(-shift, scale_log2, m_scaled);
    float row_sum = 0.f, row_sum_rounded = 0.f;
#pragma unroll
    for (int nt = 0; nt < kNTS; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float& x = s[mt][nt][2 * half + e];
            if (kEmu > 0 && exp2_emulated<kEmu>(nt))
                x = exp2_poly<kDegree>(fmaf(x, scale_log2, -offset_log2));
            else
                x = exp2_scaled(x, scale_log2, offset_log2);
            row_sum += x;
        }
        add_rounded<RoundTo>(row_sum_rounded, s[mt][nt][2 * half], s[mt][nt][2 * half + 1]);
    }
    l = l * alpha + row_sum;
    if constexpr (RoundedSum<RoundTo>::kOn) lr = lr * alpha + row_sum_rounded;
}

// lr: RoundTo's rounded row sums (softmax_row_update); with RoundTo void, untouched (pass l)
template <bool kLazy, int kEmu = 0, int kDegree = 3, class RoundTo = void, int kMT, int kNTS>
__device__ __forceinline__ void softmax_step_max(float (&s)[kMT][kNTS][4], float (&m)[kMT][2],
                                                 float (&l)[kMT][2], float (&lr)[kMT][2], const float (&mx)[kMT][2],
                                                 float scale_log2, float (&alpha)[kMT][2], bool& rescale) {
    rescale = !kLazy;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            softmax_row_update<kLazy, false, kEmu, kDegree, RoundTo>(s, mt, half, fmaxf(m[mt][half], mx[mt][half]), 0.f,
                                                                     m[mt][half], l[mt][half], lr[mt][half],
                                                                     scale_log2, alpha[mt][half], rescale);
}

// The row-max step with the maximum deferred (sm90_fwd.cu kDeferMax): the block's P from the running
// max m as it was (m_old), not from the block's, so that the exp2s need not wait for the row max (its
// FMNMX chain and quad shuffles, then the max's tanh, were ahead of every exp2); the max still gives m
// (kLazyRescaleLog2's move rule, softmax_row_update) once the step has run, and the move's factor
// 2^((m_old - m)·scale_log2) scales l now and O one step later: alpha (O *= alpha in this step's
// rescale, after P_{j-1} V_{j-1}) is the previous step's factor, alpha_next this one's (for P_j V_j,
// taken by O in the next step). O's last factor is never applied: O is normalized by the row sum of
// the P̃ the GEMM took, which the tensor cores keep with O's scale (sm90_fwd.cu kRowSumMma).
// The caller's condition (sm90_fwd.cu defer_ok, deferred_fits): every row's m > -inf and (1 - m)·scale_log2 <=
// DeferRangeLog2<Elem>, which bounds the block's P by 2^DeferRangeLog2 (t <= 1 for every score): bf16 100
// (P V's fp32 sums stay finite below |V|·BN < 2^27), fp16 15 (P itself must stay below fp16's 65504).
template <class Elem> struct DeferRangeLog2 { static constexpr float value = 100.f; };
template <> struct DeferRangeLog2<fp16> { static constexpr float value = 15.f; };
template <int kEmu = 0, int kDegree = 3, int kMT, int kNTS>
__device__ __forceinline__ void softmax_step_deferred(float (&s)[kMT][kNTS][4], float (&m)[kMT][2],
                                                      float (&l)[kMT][2], const float (&mx)[kMT][2],
                                                      float scale_log2, float (&alpha)[kMT][2],
                                                      float (&alpha_next)[kMT][2], bool& rescale) {
    rescale = false;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            alpha[mt][half] = alpha_next[mt][half];          // the previous step's move, for O
            rescale |= alpha[mt][half] != 1.f;
            const float m_old = m[mt][half];
            // the block's P from m_old (softmax_row_update with m_new = m_old: no move, l += the row's sum)
            float unmoved = 1.f;
            bool moved = false;
            softmax_row_update<true, false, kEmu, kDegree>(s, mt, half, m_old, 0.f, m[mt][half], l[mt][half],
                                                           l[mt][half], scale_log2, unmoved, moved);
            const float m_max = fmaxf(m_old, mx[mt][half]);
            const bool move = (m_max - m_old) * scale_log2 > kLazyRescaleLog2;
            const float a = move ? exp2_approx((m_old - m_max) * scale_log2) : 1.f;
            m[mt][half] = move ? m_max : m_old;
            l[mt][half] *= a;
            alpha_next[mt][half] = a;
        }
}

// sm90_fwd.cu kDeferMax's condition for the next block, per thread (the caller takes it warp-wide):
// both rows have a max, within DeferRangeLog2<Elem> of t's bound 1
template <class Elem, int kMT>
__device__ __forceinline__ bool deferred_fits(const float (&m)[kMT][2], float scale_log2) {
    bool ok = true;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            ok = ok && m[mt][half] != neg_inf() && (1.f - m[mt][half]) * scale_log2 <= DeferRangeLog2<Elem>::value;
    return ok;
}

// ScoreMod in the folded form (header): apply() gives t = tanh(S·softcap_in) (minus
// slope / softcap_out·|i + offset - j| with ALiBi); unit() is the factor the softmax's scales
// take (softcap_out with kSoftcap, else 1: then it is ScoreMod exactly); cap() maps a row max of
// the raw S to the row max of t (tanh is increasing; -inf stays -inf).
template <bool kSoftcap, bool kAlibi>
struct FoldedScoreMod {
    static constexpr bool kOn = kSoftcap || kAlibi;
    float softcap_in;    // scale / softcap
    float unit_;         // softcap / scale (kSoftcap), else 1
    float slope;         // ALiBi slope / scale / unit_ of this (batch, head)
    int offset;          // seqlen_k - seqlen_q

    __device__ __forceinline__ FoldedScoreMod(float softcap_in_, float softcap_out, const float* slopes,
                                              i64 slopes_batch_stride, int batch, int head,
                                              float softmax_scale, int seqlen_q, int seqlen_k)
        : softcap_in(softcap_in_), unit_(kSoftcap ? softcap_out : 1.f), slope(0.f),
          offset(kAlibi ? seqlen_k - seqlen_q : 0) {
        if (kAlibi) slope = slopes[batch * slopes_batch_stride + head] / (softmax_scale * unit_);
    }
    __device__ __forceinline__ float unit() const { return unit_; }
    __device__ __forceinline__ float cap(float s_max) const {
        return kSoftcap && s_max != neg_inf() ? tanh_approx(s_max * softcap_in) : s_max;
    }
    __device__ __forceinline__ float apply(float s, int query, int key) const {
        if (kSoftcap) s = tanh_approx(s * softcap_in);
        if (kAlibi) s = fmaf(-slope, fabsf(static_cast<float>(query + offset - key)), s);
        return s;
    }
    // A tile of S in the mma C layout (as ScoreMod::apply): element e of tile (mt, nt) is query
    // query0 + 16·mt + g + 8·(e / 2), key key0 + 8·nt + 2t + e % 2. ALiBi's distance in fp32 (exact
    // below 2^24): per row r = (query + offset) - (key0 + 2t), one conversion per row and block;
    // per element |r - (8·nt + e % 2)|, an FADD with a constant and the FFMA's |.|, where
    // ScoreMod converts every element's integer distance (I2F, on the SFU's 16-per-clock pipe that
    // the exp2s and tanhs use).
    template <int kMT, int kNT>
    __device__ __forceinline__ void apply(float (&acc)[kMT][kNT][4], int query0, int key0, int g, int t) const {
        if (!kOn) return;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float r = static_cast<float>(query0 + mt * 16 + g + 8 * half + offset - key0 - 2 * t);
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& s = acc[mt][nt][2 * half + e];
                        if (kSoftcap) s = tanh_approx(s * softcap_in);
                        if (kAlibi) s = fmaf(-slope, fabsf(r - static_cast<float>(nt * 8 + e)), s);
                    }
            }
    }
};


// Folded softcap with Q prescaled (kFoldCap 4): this consumer warpgroup's 64 rows of Q_i multiplied
// by softcap_in in shared memory once per tile, so that S = Q Kᵀ arrives as S·softcap_in and the
// tanh takes it without a multiply per score (64 x head_dim products per tile against 64 x BN
// per K/V block). bf16 only: the products keep bf16's exponent range, where fp16's would fall to
// subnormals for small entries (softcap_in = scale / softcap is ~0.003 at d128 and cap 30); one
// more rounding of Q (2^-9), below the scores' own bf16 error. The rows are kChunks chunks of 64
// rows x 128 bytes, kChunkBytes apart (the swizzle permutes 16-byte units within rows, which an
// element-wise scale does not see): 16-byte unit i of the warpgroup is thread i % 128's.
template <int kChunks, int kChunkBytes>
__device__ __forceinline__ void prescale_q(u32 q_wg, float softcap_in, int lane128) {
#pragma unroll 1   // (unrolled, ptxas spilled 8 bytes of the causal BN 144 kernel: nvcc 13.0)
    for (int i = lane128; i < kChunks * 64 * 8; i += 128) {
        const u32 addr = q_wg + (i / 512) * kChunkBytes + (i % 512) * 16;
        u32 r[4];
        ld_shared_v4(addr, r);
#pragma unroll
        for (int j = 0; j < 4; ++j)
            r[j] = pack2<bf16>(__uint_as_float(r[j] << 16) * softcap_in,
                               __uint_as_float(r[j] & 0xffff0000u) * softcap_in);
        st_shared_v4(addr, r);
    }
}

// ALiBi's bias as one FFMA per score (kAlibiLinear). Element e of tile nt of a thread's row is key
// key0 + 2t + c with c = 8·nt + e % 2 (the mma C layout), and its bias is -slope·|r - c| with
// r = query + offset - key0 - 2t. Where every key of the block lies on one side of every row's
// diagonal key (sign σ = +1: keys at or left of it, -1: at or right), |r - c| = σ (r - c), so
//   S + bias = (S + σ·slope·c) + shift,   shift = -σ·slope·r   (one per row and block),
// the first term one FFMA with the compile-time c, the second folded into the softmax's exponent
// offset (softmax_step_shift) instead of added to each score. Causal: every visible key is left
// of its row's diagonal, so σ = +1 on every block (the keys right of it are masked to -inf after
// this, whatever their bias). A block across the diagonal (non-causal: the few around it) takes
// the exact form, -slope·|r - c| in fp32 with shift 0 (as FoldedScoreMod's fp32 distances).
struct AlibiLinear {
    float slope;    // ALiBi slope / softmax scale (raw units of S) of this (batch, head)
    int offset;     // seqlen_k - seqlen_q: query i's diagonal key is i + offset

    // on: whether the kernel runs it (kAlibiLinear); off, nothing is read (slopes may be null)
    __device__ __forceinline__ AlibiLinear(bool on, const float* slopes, i64 slopes_batch_stride, int batch,
                                           int head, float softmax_scale, int seqlen_q, int seqlen_k)
        : slope(on ? slopes[batch * slopes_batch_stride + head] / softmax_scale : 0.f),
          offset(seqlen_k - seqlen_q) {}

    // σ of a block of kBN keys from key0 and the 16 rows of a warp from row0: +1 (every key at or
    // left of every row's diagonal key), -1 (every key at or right of it), 0 (across).
    template <int kBN>
    __device__ __forceinline__ int side(int row0, int key0) const {
        if (key0 + kBN - 1 <= row0 + offset) return 1;
        if (key0 >= row0 + 15 + offset) return -1;
        return 0;
    }

    // S += bias for a tile of S in the mma C layout (one warp's 16 rows: kMT = 1), shift[mt][half]
    // the part of each row's bias left out of the scores: σ != 0 the linear form, σ = 0 the exact
    // one (shift 0).
    template <int kMT, int kNT>
    __device__ __forceinline__ void apply(float (&acc)[kMT][kNT][4], float (&shift)[kMT][2], int query0,
                                          int key0, int g, int t, int sigma) const {
        const float ss = sigma > 0 ? slope : -slope;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float r = static_cast<float>(query0 + mt * 16 + g + 8 * half + offset - key0 - 2 * t);
                if (sigma != 0) {
                    shift[mt][half] = -ss * r;
#pragma unroll
                    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float& s = acc[mt][nt][2 * half + e];
                            s = fmaf(ss, static_cast<float>(nt * 8 + e), s);
                        }
                } else {
                    shift[mt][half] = 0.f;
#pragma unroll
                    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float& s = acc[mt][nt][2 * half + e];
                            s = fmaf(-slope, fabsf(r - static_cast<float>(nt * 8 + e)), s);
                        }
                }
            }
    }
};

// softmax_step_max with each row's scores offset by shift[mt][half] (AlibiLinear: the true score
// is s + shift): the row max of s plus the shift (one add per row, before the quad reduction: the
// four threads of a row have different shifts), and the shift in the exponent's offset,
// exp2(s·scale_log2 - (m·scale_log2 - shift·scale_log2)). m, l, alpha and the LSE are plain
// attention's. kLazy as softmax_step_max.
template <bool kLazy, int kMT, int kNTS>
__device__ __forceinline__ void softmax_step_shift(float (&s)[kMT][kNTS][4], const float (&shift)[kMT][2],
                                                   float (&m)[kMT][2], float (&l)[kMT][2], float scale_log2,
                                                   float (&alpha)[kMT][2], bool& rescale) {
    rescale = !kLazy;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float x = neg_inf();
#pragma unroll
            for (int nt = 0; nt < kNTS; ++nt)
                x = fmaxf(x, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
            softmax_row_update<kLazy, true>(s, mt, half, fmaxf(m[mt][half], quad_max(x + shift[mt][half])),
                                            shift[mt][half], m[mt][half], l[mt][half], l[mt][half], scale_log2,
                                            alpha[mt][half], rescale);
        }
}

}  // namespace cuflash
