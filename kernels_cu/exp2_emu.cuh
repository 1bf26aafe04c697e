// exp2_emu.cuh: exp2 on the FMA / ALU pipes instead of the SFU (MUFU.EX2), for a fraction of
// the softmax's elements (FlashAttention-4's trick), and the online-softmax step that uses it.
// sm90_fwd's kEmuExp2 (cuflash/families/sm90_fwd.py: emu_exp2) switches it on; at 0 the kernel
// calls softmax.cuh's softmax_step and this file adds no code.
//
// Why: an SM's SFU does 16 operations per clock, its FMA pipes 128. The Hopper forward keeps
// the tensor cores busy and runs the softmax under the GEMMs; with softcap every score needs two
// SFU operations (tanh.approx, then ex2.approx) and the SFU becomes the bottleneck. Computing
// the exp2 of some 8-column tiles of S with ~10 FMA/ALU instructions instead moves work off the
// SFU onto pipes that have room.
//
// The software exp2 (exp2_poly), for x <= 0 (the softmax's exponents: s·scale·log2e - m·scale·log2e,
// or -inf for a masked score):
//   2^x = 2^j · 2^f,   j = round(x) (to nearest), f = x - j in [-1/2, 1/2]
//   j:   t = x + 1.5·2^23 rounds x to an integer held in t's low mantissa bits (two's complement,
//        the 1.5 keeps t's exponent fixed for |x| < 2^22); t - 1.5·2^23 is j exactly, and
//        f = x - j is exact (Sterbenz)
//   2^j: (bits(t) << 23) + (127 << 23) is j + 127 in the exponent field (the shift drops t's own
//        exponent and mantissa top bits), one IMAD; for j = -127 it wraps to 0, i.e. +0.0
//   2^f: p(f) = 1 + c1 f + ... + cn f^n by Horner (n FFMA), the constant exactly 1 so that
//        p(0) = 1; c1..cn minimise max |p(f) / 2^f - 1| on [-1/2, 1/2] (minimax, fitted in
//        float64 and rounded to float32 by results/NVIDIA_H100_80GB_HBM3/scripts/exp2_poly_fit.py;
//        the errors are of the float32 polynomial evaluated with FMA):
//          degree 3: 1.01e-4 (13.3 bits)   degree 4: 2.9e-6 (18.4 bits)
//        P feeds the P V GEMM rounded to 16 bits and l in fp32 (so O = Σ P V / l sees the same
//        error in numerator and denominator, apart from the 16-bit rounding): bf16's unit
//        roundoff 2^-9 = 2e-3 is 19x degree 3's error, fp16's 2^-11 = 4.9e-4 only 5x, so fp16
//        takes degree 4 (170x), bf16 degree 3 (one FFMA fewer).
//   result: p(f) · 2^j (one FMUL)
// Special values, as ex2.approx.ftz gives them where it matters:
//   -inf (masked): clamped to -127 -> j = -127, f = 0, 2^j = +0.0: exactly 0
//   0:             j = 0, f = 0, p = 1: exactly 1 (the row's max element)
//   x < -126:      0 or a value below 2^-126 that the FTZ arithmetic after it flushes to 0
//                  (ex2.approx.ftz flushes it too); P is at most 1 and l at least 1, so this is
//                  far below any rounding that matters
//   NaN:           stays NaN (the clamp is a compare that NaN fails, not fmaxf; NaN · 2^j is NaN),
//                  so a NaN score still gives the row l = NaN and LSE = NaN as with ex2
//   x > 127:       not an input here (x <= 0 up to one rounding of m·scale·log2e); it would give
//                  a wrong finite value or NaN, not +inf
// tests/test_sm90_softcap_cpu.py mirrors exp2_poly in NumPy (float32, FMA) and checks these.
#pragma once
#include "ptx.cuh"
#include "softmax.cuh"

namespace cuflash {

// 2^x on the FMA / ALU pipes, degree kDegree (3 or 4) polynomial (header).
template <int kDegree>
__device__ __forceinline__ float exp2_poly(float x) {
    static_assert(kDegree == 3 || kDegree == 4, "exp2_poly: degree 3 or 4 (exp2_poly_fit.py)");
    constexpr float kShifter = 12582912.f;        // 1.5 · 2^23
    x = x < -127.f ? -127.f : x;                  // -inf -> -127 (2^j = 0); NaN passes
    const float t = __fadd_rn(x, kShifter);       // round(x) in t's low mantissa bits
    const float j = __fsub_rn(t, kShifter);       // round(x), exactly
    const float f = __fsub_rn(x, j);              // [-1/2, 1/2], exactly
    float p;
    if constexpr (kDegree == 3) {
        p = fmaf(0.0550090596f, f, 0.242210969f);
        p = fmaf(p, f, 0.693282902f);
    } else {
        p = fmaf(0.00958257634f, f, 0.0559068285f);
        p = fmaf(p, f, 0.240241066f);
        p = fmaf(p, f, 0.693124115f);
    }
    p = fmaf(p, f, 1.f);
    const float two_j = __uint_as_float((__float_as_uint(t) << 23) + (127u << 23));   // 2^j; 0 at j = -127
    return __fmul_rn(p, two_j);
}

// Degree by P's 16-bit type (header): bf16 3, fp16 4.
template <class Elem> struct Exp2PolyDegree { static constexpr int value = 4; };
template <> struct Exp2PolyDegree<bf16> { static constexpr int value = 3; };

// Whether 8-column tile nt of S takes the software exp2 at kEmu quarters: kEmu of every 4
// consecutive tiles, spread evenly (kEmu 1: tiles 3, 7, ...; 2: odd tiles; 3: all but 0, 4, ...;
// 4: all), so the unrolled code interleaves the two kinds.
template <int kEmu>
__host__ __device__ constexpr bool exp2_emulated(int nt) {
    return ((nt + 1) * kEmu) / 4 != (nt * kEmu) / 4;
}

// softmax.cuh's softmax_step, with the exp2 of P in the tiles that exp2_emulated<kEmu> picks
// computed by exp2_poly<kDegree>; the rest (and alpha) by ex2.approx. Same arguments, same
// results up to the polynomial's error.
template <int kEmu, int kDegree, int kMT, int kNTS>
__device__ __forceinline__ void softmax_step_emu(float (&s)[kMT][kNTS][4], float (&m)[kMT][2],
                                                 float (&l)[kMT][2], float scale_log2,
                                                 float (&alpha)[kMT][2]) {
    static_assert(kEmu >= 1 && kEmu <= 4, "kEmu: quarters of S's 8-column tiles, 1..4");
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float m_new = m[mt][half];
#pragma unroll
            for (int nt = 0; nt < kNTS; ++nt)
                m_new = fmaxf(m_new, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
            m_new = quad_max(m_new);
            // as softmax_step: a row masked so far uses 0 as the offset (no -inf - (-inf))
            const float m_scaled = m_new == neg_inf() ? 0.f : m_new * scale_log2;
            alpha[mt][half] = exp2_approx(m[mt][half] * scale_log2 - m_scaled);
            m[mt][half] = m_new;
            float row_sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < kNTS; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[mt][nt][2 * half + e];
                    if (exp2_emulated<kEmu>(nt))
                        x = exp2_poly<kDegree>(fmaf(x, scale_log2, -m_scaled));
                    else
                        x = exp2_scaled(x, scale_log2, m_scaled);
                    row_sum += x;
                }
            l[mt][half] = l[mt][half] * alpha[mt][half] + row_sum;
        }
}

}  // namespace cuflash
