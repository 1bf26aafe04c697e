// sm90_tail.cuh: sm90_fwd's balanced tail (kStreamTail, config `stream_tail`): the static
// persistent schedule with its last stretch split by K/V blocks (stream-K over the tail), and the
// fp32 partials that join a tile's two pieces.
//
// Why: a non-causal call with fixed lengths has n_tiles equal tiles of n K/V blocks each. The
// static persistent grid (G CTAs, one per SM) gives CTA b the tiles b, b + G, ..., so the launch
// lasts ceil(n_tiles / G) tiles while the work is n_tiles / G of them: at head dim 256, 2k keys
// (1024 tiles on 132 SMs, 7.76 waves) every CTA but 32 runs 8 tiles and the last wave leaves a
// quarter of the GPU idle.
//
// The schedule. With w = n_tiles / G (>= 1: the host launches at most n_tiles CTAs):
//   data parallel  tiles [0, dp_end), dp_end = G (w - 1): CTA b takes b, b + G, ... (w - 1 tiles)
//   stream         the other S = n_tiles - dp_end tiles (G <= S < 2G), as S·n units (tile, block)
//                  in loop order (tile-major; inside a tile the kernel's block order, j = 0..n-1),
//                  cut into G ranges of floor / ceil S·n / G units; range r goes to CTA G - 1 - r
// Each range holds at least n units (S >= G), so a tile is cut at most once: into a head piece
// (loop blocks [0, x)) at the end of range r and a rest piece ([x, n)) at the start of range r + 1.
// The rest piece (a "writer", jb > 0) runs first in its CTA's stretch and stores its unnormalized
// O, running max m and row sums l (fp32) into slot r + 1 of the partials, then releases one flag
// per thread; the head piece (the "finisher", jb = 0 and je < n) runs last in its CTA, waits for
// those flags, merges the partial into its own O, m, l (the two-part case of FlashAttention's
// online softmax: the order of the blocks does not matter) and stores the tile as usual. Every
// CTA's total is S·n / G units, give or take one, plus at most one extra piece.
// Why ranges in reverse: the finisher of range r waits for range r + 1's writer, which is CTA
// G - 2 - r, a lower blockIdx than its own G - 1 - r: a CTA only ever waits for a CTA dispatched
// before it, and the one it waits for waits for nothing before its writer piece is stored (its
// first piece of the stretch). The grid has one CTA per SM at most, so all are resident anyway.
//
// The partials (params.tail_partial, fp32, and params.tail_flags, int32; the plan's zeroed
// buffers, one per CUDA stream: cuflash.launch.StreamCounters): slot s (the writer's range, <
// the grid size) holds per consumer thread c (kCThreads of them) kOCols / 8 float4 of O (the
// thread's own accumulator fragment: writer and finisher are the same thread position, so the
// layout is the fragment's, float4 i of thread c at slot·kSlotFloat4s + i·kCThreads + c: a warp's
// 32 float4 are one 512-byte line) and one float4 (m row g, m row g + 8, l row g, l row g + 8),
// l the thread's own columns' sum (quad_sum comes in the epilogue, as without the split).
// Flag (s, c) is set to 1 by the writer thread (red.release: after its stores) and read by the
// finisher thread with ld.acquire, which then reads the partial through L2 (ld.global.cg, ptx_sm90_tail.cuh) and
// sets the flag back to 0 for the next launch (a launch on the same stream runs after this one).
#pragma once
#include "ptx.cuh"
#include "softmax.cuh"
#include "ptx_sm90_tail.cuh"

namespace cuflash {

// The CTA's pieces in order: next() returns the next piece's tile (n_tiles when done) and sets jb,
// je, the piece's loop blocks [jb, je) of its tile (a whole tile: 0, n). Every value is the same in
// all threads of the CTA and derives from the params, gridDim and blockIdx by adds, multiplies and
// compares only, so the compiler keeps the schedule, and with it the ring's iteration counters and
// the wgmma descriptors built from them, in uniform registers: with the divisions of a first
// version (the stretch's ranges, u / n) they went to per-thread registers, and every wgmma of the
// kernel waited for R2UR moves of its descriptor (13-17% slower, session 17 round 1). The host
// (cuflash/families/sm90_fwd.py stream_tail_params) computes the divisions instead:
//   dp_end   tiles [0, dp_end) run data parallel (G (n_tiles / G - 1); n_tiles without keys)
//   q, rem   the stretch's S·n units per range: q, and one more for the first rem ranges
//   magic, shift  x / n = (x · magic) >> shift for 0 <= x < 2^31 (magic = ceil(2^shift / n),
//            shift = 31 + ceil(log2 n): the error x (magic - 2^shift / n) / 2^shift < 2^-s <= 1 / n
//            never carries floor(x / n) over; the host keeps S·n < 2^31)
struct Sm90TailSchedule {
    int n_tiles;    // tiles of the launch
    int n;          // K/V blocks of every tile (0: no keys, every tile data parallel)
    int dp_end;
    u32 magic;
    int shift;
    int jb = 0, je = 0;
    int u = 0, left = 0;   // the CTA's next stream unit, (tile - dp_end)·n + j, and the units left

    __device__ __forceinline__ Sm90TailSchedule(int n_tiles_, int n_, int dp_end_, int q, int rem, int magic_,
                                                int shift_)
        : n_tiles(n_tiles_), n(n_), dp_end(dp_end_), magic(u32(magic_)), shift(shift_) {
        const int r = range();
        u = r * q + min(r, rem);
        left = q + (r < rem ? 1 : 0);
    }
    // this CTA's range of the stream stretch (reversed: header)
    __device__ __forceinline__ int range() const { return int(gridDim.x) - 1 - int(blockIdx.x); }
    __device__ __forceinline__ int div_n(int x) const { return int((u64(u32(x)) * magic) >> shift); }
    __device__ __forceinline__ int first() { return next(int(blockIdx.x) - int(gridDim.x)); }
    // (a stream tile plus the grid is past dp_end: once in the stretch, the stride never leads back)
    __device__ __forceinline__ int next(int tile) {
        const int t = tile + int(gridDim.x);
        if (t < dp_end) {
            jb = 0;
            je = n;
            return t;
        }
        if (left <= 0) return n_tiles;
        const int i = div_n(u);
        jb = u - i * n;
        je = min(n, jb + left);
        u += je - jb;
        left -= je - jb;
        return dp_end + i;
    }
    // whether the piece of `tile` (the one next() returned last) is the CTA's last
    __device__ __forceinline__ bool last(int tile) const { return tile + int(gridDim.x) >= dp_end && left <= 0; }
    // the current piece's role
    __device__ __forceinline__ bool writer() const { return jb > 0; }
    __device__ __forceinline__ bool finisher() const { return jb == 0 && je < n; }
};

// The partial of a writer piece, stored and merged per consumer thread (header: layout).
//   kOCols     O's columns (the accumulator fragment: kOCols / 8 float4 per thread)
//   kCThreads  consumer threads of the CTA (128 · consumers)
template <int kOCols, int kCThreads>
struct Sm90TailPartials {
    static constexpr int kSlotFloat4s = (kOCols / 8 + 1) * kCThreads;
    float4* partial;
    int* flags;

    // writer: O, m, l of this thread into slot `slot`, then its flag (release: after the stores)
    __device__ __forceinline__ void store(int slot, int c, const float (&o)[1][kOCols / 8][4],
                                          const float (&m)[1][2], const float (&l)[1][2]) const {
        float4* dst = partial + i64(slot) * kSlotFloat4s + c;
#pragma unroll
        for (int nt = 0; nt < kOCols / 8; ++nt)
            dst[nt * kCThreads] = make_float4(o[0][nt][0], o[0][nt][1], o[0][nt][2], o[0][nt][3]);
        dst[(kOCols / 8) * kCThreads] = make_float4(m[0][0], m[0][1], l[0][0], l[0][1]);
        red_release_add_gpu(flags + slot * kCThreads + c, 1);
    }

    // finisher: wait for slot `slot`'s flag of this thread, reset it, and merge the partial into
    // O, m, l (both parts relative to the larger max; a row that saw no key in either keeps
    // m = -inf, l = 0, O = 0: the -inf guard of softmax_step)
    __device__ __forceinline__ void merge(int slot, int c, float (&o)[1][kOCols / 8][4], float (&m)[1][2],
                                          float (&l)[1][2], float scale_log2) const {
        int* flag = flags + slot * kCThreads + c;
        // (written long before: the writer's first piece). The warp waits as one (a vote per round):
        // a per-thread spin is a divergent loop, after which ptxas kept the ring's counters and the
        // wgmma descriptors of the whole tile loop in per-thread registers (R2UR before every wgmma)
        while (!__all_sync(0xffffffffu, ld_acquire_gpu(flag) != 0)) nanosleep_ns(32);
        *flag = 0;
        const float4* src = partial + i64(slot) * kSlotFloat4s + c;
        const float4 ml = ld_cg_float4(src + (kOCols / 8) * kCThreads);
        const float m_part[2] = {ml.x, ml.y}, l_part[2] = {ml.z, ml.w};
        float mine[2], theirs[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float m_new = fmaxf(m[0][half], m_part[half]);
            const float m_scaled = m_new == neg_inf() ? 0.f : m_new * scale_log2;
            mine[half] = exp2_approx(m[0][half] * scale_log2 - m_scaled);
            theirs[half] = exp2_approx(m_part[half] * scale_log2 - m_scaled);
            m[0][half] = m_new;
            l[0][half] = l[0][half] * mine[half] + l_part[half] * theirs[half];
        }
#pragma unroll
        for (int nt = 0; nt < kOCols / 8; ++nt) {
            const float4 x = ld_cg_float4(src + nt * kCThreads);
            o[0][nt][0] = o[0][nt][0] * mine[0] + x.x * theirs[0];
            o[0][nt][1] = o[0][nt][1] * mine[0] + x.y * theirs[0];
            o[0][nt][2] = o[0][nt][2] * mine[1] + x.z * theirs[1];
            o[0][nt][3] = o[0][nt][3] * mine[1] + x.w * theirs[1];
        }
    }
};

}  // namespace cuflash
