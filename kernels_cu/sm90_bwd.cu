// sm90_bwd.cu: FlashAttention backward for Hopper (sm_90a only), built the FlashAttention-3
// way: TMA loads into an mbarrier ring, a producer warpgroup and consumer warpgroups, every
// product by wgmma.
//
// Given dO and the forward's O and LSE, with P = exp(S·scale - LSE) recomputed from Q, K:
//   D = rowsum(dO ∘ O),  dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP - D),
//   dK = scale · dSᵀ Q,  dQ = scale · dS K
//
// Three launches per backward, as fa2_bwd (whose preprocess, dQ convert and GQA reduction
// kernels this file reuses: it includes fa2_bwd.cu, and Sm90BwdParams starts with BwdParams):
//   1. fa2_bwd_preprocess   D, LSE·log2(e) into padded fp32 workspace; zeroed dQ accumulators
//   2. sm90_bwd             one CTA per K/V block K_j, V_j of one (head, batch); loops over the
//                           Q blocks Q_i that see it, keeps dK_j, dV_j in registers, adds each
//                           dQ_i contribution to the fp32 accumulator in global memory
//   3. fa2_bwd_convert_dq   dQ = scale · accumulator; fa2_bwd_reduce_dkv under GQA / MQA
//
// Grid: blockIdx.x = (pair · n_kv_blocks + n_block), pair = batch · nheads + head: the K/V blocks
// of a (head, batch) in increasing order. Under the causal mask block 0 is seen by the most Q
// blocks, so the longest CTAs start first; the deterministic mode needs that order too (the CTA
// of K/V block n waits for block n - 1's dQ additions, which was launched before it). With kLpt
// the grouped order of fa2_bwd instead (sm90_bwd_lpt_tile: K/V block 0 of a few pairs, then
// block 1, ...), which keeps both properties and evens out the causal tail.
//
// Producer (warp 0 of warpgroup 0; the other 3 warps exit, but for kDqWriter's warp 1 and kDqFirst's warp 2): lane 0
// issues the TMA copies, K_j and V_j once (one barrier, kv_full), then per Q block Q_i and dO_i into one slot of a ring of
// kStages slots; the 32 lanes copy the block's rows of LSE·log2e and D (kBM / 2 chunks of 16
// bytes) by cp.async into the same slot, wait for them, and arrive on the slot's q_full.
//
// mbarriers: kv_full (one arrival with the K and V bytes), and per slot q_full (33 arrivals:
// lane 0's with the Q and dO bytes, then each lane's once its LSE / D chunks have landed;
// the arrival's release makes those generic-proxy writes visible to the consumers) and q_empty (kConsumers · 128 arrivals, each consumer thread once it has
// waited for the iteration's last GEMM that reads Q_i or dO_i). Phases: the n-th fill of a slot
// (n = it / kStages) is waited for with parity n & 1; before refilling it the producer waits
// for release n - 1, parity (n - 1) & 1.
//
// Consumers (warpgroups 1..kConsumers; consumer wg owns keys 64·wg..64·wg+63 of K_j, 16 per
// warp). Per Q block, all by wgmma (per warpgroup: M = its 64 keys):
//   Sᵀ  = K_j Q_iᵀ                 SS, N = BM queries                     (group 1, waited)
//   Pᵀ  = exp2(Sᵀ·scale·log2e - LSE_i·log2e), masked (ragged end, causal diagonal, window
//         band) -> 0; softcap / ALiBi modify Sᵀ first (score.cuh), dropout zeroes dropped Pᵀ;
//         packed to 16-bit A fragments (the fp32 Pᵀ dies before dPᵀ's accumulators are born)
//   dPᵀ = V_j dO_iᵀ                SS, N = BM                             (group 2)
//   dV_j += Pᵀ dO_i                RS: Pᵀ from registers, dO_i MN-major   (group 3)
//   dSᵀ = Pᵀ ∘ (dPᵀ - D_i)         once dPᵀ is done, while dV runs (Pᵀ as rounded to 16 bits)
//   dK_j += dSᵀ Q_i                RS: dSᵀ from registers, Q_i MN-major   (group 4)
//   dS to shared memory (transposed by stmatrix.trans: ds_smem holds dS, queries x keys, K-major,
//         16-byte rows, no bank conflicts), while dV and dK run; then wait for them (their fragments die)
//   dQ_i part = dS K_j              SS: dS (A, K-major), K_j (B, MN-major)  (group 5)
//     the BM x head_dim tile is split over the consumer warpgroups: by 64-row groups when
//     BM = 64 · kConsumers, else by head-dim column groups (kDqN columns each: 64, or at head
//     dim 64 with 2 consumers and BM 64, 32: wgmma m64n32k16, K_j's B operand starting halfway
//     into its 128-byte rows)
//   dQ accumulator += dQ_i part     red.global.add.v4.f32 (16 bytes per thread per 16x16 tile);
//                                  with kDqBulk through a shared-memory staging tile and one bulk
//                                  reduce-add per row (cp.reduce.async.bulk, below)
// The accumulator layout per warp is mma.sync's C layout (ptx_sm90.cuh Wgmma): thread (g, t)
// holds rows g, g + 8 of the warp's 16 and columns 8i + 2t + e; for Sᵀ, dPᵀ rows are keys and
// columns queries, so LSE and D are read per column, and the mask goes element by element.
// ds_smem is reused every Q block: named barrier 1 (the consumer threads) before the dS stores
// (every warpgroup's last dQ GEMM has completed) and after them (all of dS is written; with
// fence.proxy.async first, so that wgmma's async proxy sees the generic-proxy stores).
//
// Deterministic (kDeterministic): dQ_i's additions go in K/V block order, as fa2_bwd: the
// turn counter of (head, batch, Q block) counts the K/V blocks that have added; the K/V blocks
// that see a Q block are a contiguous run (0..n_max under the causal mask; under a window,
// from the band's first block kv_block_begin), and the CTA of the run's i-th block waits for
// turn i, adds, and passes the turn on. Bitwise reproducible.
//
// Registers: setmaxnreg, FA3's splits: producer / consumer 56 / 256 (1 consumer), 24 / 240 (2).
// Live per consumer thread: dK_j, dV_j (head_dim / 2 fp32 each) throughout; then Sᵀ (BM / 2), or
// the 16-bit Pᵀ fragments (BM / 4) with dPᵀ (BM / 2) and the dSᵀ fragments (BM / 4), or the dQ
// part (kDqN / 2). The order above keeps that peak low: at d128 ptxas (nvcc and NVRTC 13.0)
// spills otherwise. Loop-invariant addresses are kept few for the same reason (DescLo, the dS
// stores' one lane address, the ring position counted along).
//
// Shared memory (base aligned to 1024 bytes; every 16-bit tile as head_dim / 64 (or BN / 64 for
// dS) column chunks of rows x 64 elements, 128 bytes a row, 128-byte swizzle, as TMA writes it
// and wgmma reads it):
//   k_smem, v_smem [kChunks][BN][64]; q_smem, do_smem [kStages][kChunks][BM][64];
//   ds_smem [BN / 64][BM][64]; lse_smem, D_smem [kStages][BM] fp32; then the mbarriers; then,
//   with softcap or dropout, each consumer thread's words (Sm90BwdThreadWords), and with
//   kDqBulk the dQ staging tile (Sm90BwdDqStage), with kDqWriter its staging tiles
//   (Sm90BwdDqWriterStage, 1024-byte aligned).
//
// Template parameters (cuflash/families/sm90_bwd.py Sm90BwdConfig mirrors and validates them):
//   kBM        queries of a Q block: 64 or 128 (the N of Sᵀ, dPᵀ; the K of dV, dK)
//   kBN        keys of the CTA's K/V block: 64 · kConsumers
//   kStages    Q/dO ring slots, >= 2
//   kConsumers consumer warpgroups, 1 or 2
//   kHeadDim   64, 128 or 256 (the real head dim, params.head_dim, may be smaller: TMA fills the
//              columns past it with zeros and the stores skip them). 256 takes kBN 64 with 2
//              consumers (kSharedKeys, below)
//   Elem       bf16 or fp16; all accumulation in fp32
//   kCausal    bottom-right aligned causal mask
//   kDeterministic  ordered dQ additions (above)
//   kWindow, kSoftcap, kAlibi  as in fa2_bwd.cu (appended; false: the plain kernel, unchanged):
//              the band mask (mask.cuh BandMask) skips the Q blocks outside K_j's band, so a CTA's
//              work is proportional to the band, and masks the blocks on its edges; Sᵀ goes
//              through the forward's score modifiers (score.cuh: softcap, ALiBi) before Pᵀ is
//              recomputed (the mask then sets hidden elements of Pᵀ to 0); softcap's factor
//              1 - tanh² waits for dSᵀ = Pᵀ ∘ (dPᵀ - D_i) ∘ (1 - tanh²) in shared memory, 16 bits
//              per element, past the mbarriers (Sm90BwdThreadWords: BM / 2 elements per consumer
//              thread; kept in registers it spills d128). Deterministic under a window: the turns
//              of a Q block count from the first K/V block of its band (kv_block_begin).
//   kDropout   attention dropout (appended after them), as fa2_bwd's: the forward's keep mask Z
//              regenerated (philox.cuh, keyed by element coordinates, so bit-identical to every
//              forward's), the dropped elements of Pᵀ negated (the sign carries Z);
//              dV_j += (Pᵀ ∘ Z / (1 - p)) dO_i and dSᵀ = |Pᵀ| ∘ (Z ∘ dPᵀ / (1 - p) - D_i), the
//              signed Pᵀ waiting for dSᵀ in the thread's shared-memory words (as softcap's).
//   kDropPacked (appended last; kDropout alone, head dims 64 / 128, unordered) 1: the keep mask as
//              byte signs (dropout_transposed.cuh: no per-element keep bits) applied to Pᵀ's packed
//              16-bit words, a permute and two LOP3s per two elements; dV_j += (Pᵀ ∘ Z) dO_i
//              with the 1 / (1 - p) in the epilogue. The same mask; dV rounds Pᵀ, not Pᵀ / (1 - p),
//              to 16 bits. 2: also dS stored by stmatrix (as without dropout) instead of per
//              element (built without spills with the Philox key opaque per call: kOpaqueKeys).
//              Warp pairs sharing the Philox calls through shared memory (each drawing half of a
//              32-key block's calls) were tried: 985 instructions per Q block against 2's 993 in
//              the d128 SASS, not kept. 3: form 2 with the Philox counters for words (no rounds), NOT
//              the mask: timing only (sm90_bwd.py DROP_PACKED_TIMING). 0 (the default): the code of
//              the kernel before it existed
//   kDqBulk    (appended last) the dQ_i part goes to global memory FlashAttention-3's way: each
//              warp stores its 16 rows x kDqN fp32 fragments to its rows of a staging tile
//              (Sm90BwdDqStage, past the thread words), fence.proxy.async, and lanes 0..15 each
//              issue one cp.reduce.async.bulk add of a row (kDqN · 4 bytes) into the accumulator
//              (rows head_dim_rounded = kHeadDim floats apart; the workspace's rows are padded to
//              seqlen_q_rounded, so a ragged last block's extra rows, zeros since their Pᵀ
//              is, land in padding, as red.add's do).
//              Before rewriting its row next Q block a lane waits for the engine to have read it
//              (cp.async.bulk.wait_group.read 0, then __syncwarp); at the end for the whole
//              operation. Not with kDeterministic (its ordered additions keep red.add); with
//              kDropout at head dim 128 the config's dQ path under softcap / ALiBi
//              (Sm90BwdConfig.dropout_dq_path: the other paths spill there).
//   kOverlapSdp, kDqWriter  (appended after kDqBulk) FlashAttention-3's backward schedule:
//   kOverlapSdp  dPᵀ = V_j dO_iᵀ is issued right behind Sᵀ (groups 1 and 2), and only Sᵀ is
//              waited for (wgmma_wait<1>): the tensor cores run dPᵀ while the thread computes Pᵀ;
//              dV is issued after Pᵀ's fragments (group 3) and wgmma_wait<1> then waits for dPᵀ.
//              Sᵀ and dPᵀ (BM / 2 fp32 each) are live together with dK, dV: the config allows it
//              at head dim 64, and at 128 without softcap, ALiBi or dropout (ptxas spills those;
//              Sm90BwdConfig.overlap_sdp_spills); the mask goes after the exp2 (fill 0).
//   kDqWriter  the dQ_i part goes through shared memory to a writer warp (warp 1 of the
//              producer warpgroup, otherwise idle): the consumers store their fragments into a
//              staging tile of the whole BM x kHeadDim part (Sm90BwdDqWriterStage: 32-column
//              boxes, 128-byte swizzle; 2 tiles where they fit), fence.proxy.async, and arrive on
//              named barrier 2 + tile; the writer waits there, its lane 0 issues kHeadDim / 32
//              tensor bulk reduce-adds (cp.reduce.async.bulk.tensor, the map tma_dq over the fp32
//              accumulator), waits for the engine to have read the tile, and arrives on barrier
//              4 + tile, which the consumers wait on before rewriting that tile. Not with
//              kDeterministic or kDqBulk; with kDropout at head dim 128 the config's dQ path
//              without softcap / ALiBi (Sm90BwdConfig.dropout_dq_path).
//   kVarlen    (appended last) variable-length batches (varlen.cuh), as fa2_bwd's kVarlen and
//              sm90_fwd's: q, k, v, dO, dq, dk, dv packed as (total, heads, d), sequence b's rows
//              from cu_seqlens[b] on; the grid is sized for the longest sequence and a CTA whose
//              K/V block lies past its sequence's end leaves at once. The tensor maps span the
//              packed tensors and a box starts at row cu_seqlens[b] + offset: the rows past a
//              sequence's end that a box covers are the next sequence's, so every mask is built
//              from the sequence's own lengths (keys >= seqlen_k hidden), and the queries past
//              its end get P = 0 from the workspace: fa2_bwd_preprocess writes LSE = +inf, D = 0
//              for the rows up to the sequence's length rounded up to 128 (every BM), which its
//              Q blocks read. LSE·log2e, D and the dQ accumulator in fa2_bwd's varlen workspace
//              (nheads, ws_rows), sequence b from row (cu_seqlens_q[b] + kVarlenRowPad·b) & ~7
//              (ws_row_offset; with kDqWriter the map tma_dq spans (head_dim, ws_rows, nheads)).
//              dK, dV (and the GQA fp32 dK/dV accumulators, (nheads, total_k)) at the sequence's
//              key rows. Dropout and ALiBi are keyed by the sequence index and the rows within the
//              sequence (the forward's keep mask)
//   kLpt       (appended) the launch order of sm90_bwd_lpt_tile (longest CTAs first in groups of
//              params.head_group pairs) instead of the plain one; not with kVarlen
//   kDynamic   (appended) the dynamic persistent scheduler (Sm90BwdTileRing below): a CTA per SM
//              claims tiles; not with kVarlen or kDeterministic
//   kDsDouble  (appended last) two dS buffers, Q block q's in buffer q % 2: the barrier before
//              the dS stores goes (the one after them orders both warpgroups' dQ GEMMs of Q block
//              q - 2 before the stores of Q block q)
//   kFragPin   (appended after kDkLate) Pᵀ's A fragments pinned at the wgmma fence before dPᵀ, dV:
//              without it ptxas copies one of them after the fence and injects a warpgroup.arrive
//              before each of dV's k16 steps (C7519), each step then its own group, so the wait
//              for dPᵀ also waits for 3 of dV's 4 steps
//   kDqFirst   (appended last; with kDqWriter, fixed lengths, unordered) the dQ accumulator is not
//              zeroed by the preprocess (fa2_bwd_preprocess<Elem, false, false>, half its bytes): the
//              first CTA to reach a Q block zeroes its rows (producer warp 2, otherwise idle, ahead of
//              the writer's additions; the Q block's ticket in dq_semaphore), during the main kernel's
//              compute. Only
//              rows some K/V block adds to are zeroed: the host's dq_first_covers (not causal with
//              seqlen_q > seqlen_k, windows)
//   kWideEpi   (appended after kDqFirst; plain or windowed fixed-length unordered calls) the epilogue stores dK_j, dV_j
//              16 bytes a lane (quad_transpose: a quad's lanes exchange their column pairs) where the call is
//              MHA with 16-byte aligned dk, dv; 4 bytes a lane otherwise (and without it)
//   kCapFold   (appended last; softcap without ALiBi or dropout) 1: the folded softcap step. t = tanh(Sᵀ·
//              softcap_in) in place, the mask on t (kCapHiddenT) in the masked blocks' own copy of the step,
//              Pᵀ = exp2(t·softcap·log2e - LSE·log2e) (softcap_out folded into the exponent's FFMA), and the
//              thread's softcap words keep Pᵀ ∘ (1 - t²), rounded to 16 bits once, as one 16-byte vector per
//              k16 step (STS.128 / LDS.128); dSᵀ = (Pᵀ ∘ (1 - t²)) ∘ (dPᵀ - D_i) then needs neither Pᵀ
//              unpacked from its fragments nor a multiply by 1 - t². 2: also dPᵀ - D_i rounded to 16 bits
//              and multiplied by the words two elements an instruction (mul2: dSᵀ rounded twice, packed as
//              it is; bf16 only: Sm90BwdConfig.problems). 3: as 2, with a quarter of the exp2s (word 3 of each
//              k16 step) on the FMA pipes (exp2_emu.cuh exp2_poly, degree 3: bf16's): the step is bound by the
//              SFU (two MUFU per score, both warpgroups' steps at once), and each MUFU moved costs ~9 FMA /
//              ALU instructions, which have room (session 23, H100, tests/softcap_bwd_timing.py kvariants:
//              1/8, 1/4, 1/2 of them moved, the quarter fastest). 0 (the default): the code of the kernel
//              before it existed
//   kDqTail    (appended last; with kDqWriter and kDynamic, fixed lengths, unordered) the dQ convert as
//              a programmatic dependent kernel (sm90_bwd_dq_tail) that converts the pairs done on the SMs
//              the grid's end leaves idle: this kernel lets it launch once every CTA has started, and its
//              writer counts each tile's completed additions per pair (Sm90BwdDqTail): 1 at the tile's end
//              (waiting for its additions), 2 behind the next tile's first Q block (no wait at the boundary)
//
// Head dim 256 (kSharedKeys: kBN 64 with 2 consumers, kBM 64; Sm90BwdShape). dK_j, dV_j of 64
// keys x 256 fp32 would take 256 registers per thread in one warpgroup, so both warpgroups take
// the same 64 keys and split the work: warpgroup wg
//   Sᵀ, dPᵀ = K_j Q_iᵀ, V_j dO_iᵀ for queries 32·wg..+31 (kSN = 32: wgmma m64n32k16, Q_i / dO_i
//         from row 32·wg, whole swizzle periods in), Pᵀ and dSᵀ as above;
//   Pᵀ, dSᵀ (64 keys x its 32 queries, 16 bits) stored as they are by stmatrix into p_smem,
//         dst_smem (keys x BM queries, one 128-byte swizzled row per key: K-major A operands),
//         dS (transposed) into ds_smem as above; named barrier 1, as for dS, covers all three;
//   dV_j, dK_j += Pᵀ dO_i, dSᵀ Q_i for columns 128·wg..+127 (kDkvN = 128; SS: all BM queries'
//         Pᵀ, dSᵀ from shared memory, both warpgroups reading both halves; dO_i, Q_i MN-major
//         from column chunk 2·wg), one commit group with ...
//   dQ_i part = dS K_j for columns 128·wg..+127 (kDqN), in two 64-column pieces (one piece's
//         32 accumulators live next to dK_j, dV_j's 128), each added by red.add as soon as it is
//         done (waiting for the first also waits for dV, dK: then q_empty is released); ordered
//         (one turn for both pieces) when kDeterministic. kDqBulk's staging does not fit next to
//         this tile; kDqWriter stages dQ_i's part in the ring slot of Q_i, dO_i instead, in the
//         chunks only this warpgroup's dV, dK read (Sm90BwdSlotDqStage, kSlotDq), and the slot is
//         released by the consumer threads (their reads, LSE_i and D_i's included, are done) and
//         by the writer warp after its bulk reduce-adds. kCluster: see sm90_bwd_body.
// kRoles (appended last; with kDqWriter, plain unordered calls): the warpgroups split by operand
//   instead (the consumer section's kRoles block): warpgroup 0 Sᵀ (m64n64, all BM queries), Pᵀ,
//   dV_j += Pᵀ dO_i for all 256 columns (RS); warpgroup 1 dPᵀ, dSᵀ with Pᵀ handed over in shared
//   memory, dK_j += dSᵀ Q_i (RS), dS; both dQ_i by columns as above. Fewer shared-memory bytes per
//   Q block (m64n64 instead of m64n32 products reading K_j, V_j; no Pᵀ, dSᵀ tiles for SS dV, dK).
//   With kSAhead the next Q block's Sᵀ / dPᵀ is issued behind the last dQ GEMM.
// Softcap's and dropout's words (kSN / 4 each) stay in registers here. The loop-invariant
// descriptors of K_j, V_j, Pᵀ, dSᵀ, dS are re-derived at each use (opaque_u32): hoisted out of
// the loop, one per k-step, they spilled. Head dims 129..255 run this kernel (TMA zero-fills the
// columns past the real head dim, whole 64-column boxes past it at 192). It runs the plain grid
// only: not with kDynamic or kDsDouble (static_assert; the config refuses lpt there too).
#include "fa2_bwd.cu"
#include "ptx_sm90.cuh"
#include "params_sm90_bwd.cuh"
#include "ptx_sm90_bulk.cuh"
#include "ptx_sm90_bwd.cuh"
#include "exp2_emu.cuh"
#include "dropout_transposed.cuh"
// (ptx_decode.cuh: grid_dependency_wait, launch_dependents for kDqTail)
#include "ptx_decode.cuh"

namespace cuflash {

// Sm90BwdParams derives from BwdParams, so fa2_bwd's kernels read its leading bytes as their own
// params (tests/test_sm90_bwd_cpu.py checks the layout launch.py packs against nvcc's).

template <int kBM, int kBN, int kStages, int kConsumers, int kHeadDim, bool kDynamic = false,
          int kDsBufs = 1>
struct Sm90BwdShape {
    static constexpr int kThreads = (kConsumers + 1) * 128;
    static constexpr int kChunks = kHeadDim / 64;           // 64-column (128-byte) swizzle atoms
    static constexpr int kQChunkBytes = kBM * 128;          // one column chunk of Q_i (or dO_i, dS)
    static constexpr int kKVChunkBytes = kBN * 128;         // one column chunk of K_j (or V_j)
    static constexpr int kQBytes = kBM * kHeadDim * 2;
    static constexpr int kKVBytes = kBN * kHeadDim * 2;
    static constexpr int kDsBytes = kBM * kBN * 2;
    // kSharedKeys (head dim 256: BN 64, 2 consumers): the consumer warpgroups share the K/V
    // block's 64 keys. dK_j, dV_j (64 keys x 256 fp32 each) fit only split by head-dim columns
    // (kDkvN per warpgroup), so each warpgroup computes Sᵀ, dPᵀ for its kSN of the BM queries and
    // Pᵀ, dSᵀ go through shared memory (p_smem, dst_smem: keys x queries, K-major), where every
    // warpgroup reads all of them as the A operands of dV, dK.
    static constexpr bool kSharedKeys = kBN == 64 && kConsumers == 2;
    static constexpr int kSN = kSharedKeys ? kBM / kConsumers : kBM;        // queries of a warpgroup's Sᵀ
    static constexpr int kDkvN = kSharedKeys ? kHeadDim / kConsumers : kHeadDim;  // dK_j, dV_j columns
    static constexpr int kVOffset = kKVBytes;
    static constexpr int kQOffset = 2 * kKVBytes;
    static constexpr int kDoOffset = kQOffset + kStages * kQBytes;
    static constexpr int kDsOffset = kDoOffset + kStages * kQBytes;
    static constexpr int kPOffset = kDsOffset + kDsBytes;             // kSharedKeys: Pᵀ, then dSᵀ
    static constexpr int kDstOffset = kPOffset + kDsBytes;
    // kSharedKeys: dS, Pᵀ, dSᵀ; kDsDouble: 2 dS buffers
    static constexpr int kLseOffset = kDsOffset + (kSharedKeys ? 3 : kDsBufs) * kDsBytes;
    static constexpr int kDOffset = kLseOffset + kStages * kBM * 4;
    static constexpr int kBarOffset = kDOffset + kStages * kBM * 4;
    // kv_full; q_full, q_empty per slot; kDynamic: kv_empty, dq_writer's 2 tile-free barriers, the
    // tile ring's 2 full and 2 empty (Sm90BwdTileRing), then the ring's 2 int slots
    static constexpr int kBarriers = 1 + 2 * kStages + (kDynamic ? 7 : 0);
    static constexpr int kBarEnd = kBarOffset + 8 * kBarriers + (kDynamic ? 24 : 0);  // kDynamic: 2 tile slots, a count
    static constexpr int kSmemBytes = kBarEnd + 1024;       // + 1024: base alignment
    static constexpr int kSlotBytes = 2 * kQBytes;          // Q_i, dO_i: the TMA bytes of a slot
    // dQ_i split over the consumers: kDqRowGroups x kDqColGroups warpgroups of 64 x kDqN
    static constexpr int kDqRowGroups = kBM / 64;
    static constexpr int kDqColGroups = kConsumers / kDqRowGroups;
    static constexpr int kDqN = kHeadDim / kDqColGroups;
    static constexpr int kProducerRegs = kConsumers == 1 ? 56 : 24;
    static constexpr int kConsumerRegs = kConsumers == 1 ? 256 : 240;

    static_assert(kConsumers == 1 || kConsumers == 2, "consumers must be 1 or 2");
    static_assert(kBN == 64 * kConsumers || kSharedKeys,
                  "BN must be 64 * consumers (each consumer warpgroup owns 64 keys), or 64 shared by 2");
    static_assert(!kSharedKeys || kBM == 64, "shared keys: BM must be 64 (32 queries of Sᵀ per warpgroup)");
    static_assert(kHeadDim <= 128 || kSharedKeys,
                  "head dim 256: BN 64 with 2 consumers (dK_j, dV_j split by columns over the warpgroups)");
    static_assert(!kSharedKeys || kDsBufs == 1, "shared keys (head dim 256): one dS buffer (no kDsDouble)");
    static_assert(kBM == 64 || kBM == 128 || (kBM == 80 && kHeadDim == 128 && kConsumers == 2 && !kSharedKeys),
                  "BM must be 64 or 128 (the wgmma N of S and dP), or 80 at head dim 128 with 2 consumers "
                  "(the swapped dQ GEMM)");
    static_assert(kDqRowGroups <= kConsumers && kConsumers % kDqRowGroups == 0,
                  "BM / 64 must divide consumers: each warpgroup computes 64 rows of dQ_i");
    static_assert(kDqN % 64 == 0 || kDqN == 32,
                  "each warpgroup's dQ columns must be whole 64-column chunks, or one 32-column half of one");
    static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dim must be 64, 128 or 256");
    static_assert(kStages >= 2, "stages must be >= 2: the producer fills one slot while another is read");
    static_assert(kSmemBytes <= 227 * 1024, "shared memory exceeds the H100's 227 KB");
};

// Per-thread 32-bit words in shared memory past the mbarriers (Sm90BwdConfig.smem_bytes adds
// them): softcap's 1 - tanh² and dropout's signed Pᵀ, BM / 4 words each (two 16-bit elements a
// word, packed as pack_a_frags packs Pᵀ), wait there from Sᵀ to dSᵀ. Word-major: word w of
// consumer thread c sits at kOffset + (w · consumer threads + c) · 4, so a warp's 32 accesses to
// one word are 32 consecutive words, one per bank (thread-major, 16 bytes per thread, they were
// 4-way bank-conflicted).
template <class Shape, int kConsumers, int kWords>
struct Sm90BwdThreadWords {
    static constexpr int kOffset = (Shape::kBarEnd + 15) / 16 * 16;
    static constexpr int kBytes = kWords * 4 * kConsumers * 128;
    static constexpr int kSmemBytes = kOffset + kBytes + 1024;  // + 1024: base alignment
    static_assert(kWords % 4 == 0, "BM / 4 words per flag, BM a multiple of 16");
};

// kDqBulk: the staging tile of the dQ_i parts in shared memory, past the thread words (or the
// mbarriers): per consumer warpgroup 64 rows x (kDqN + 8) fp32, row-major. Each row is one bulk
// reduce-add (kDqN · 4 bytes, 16-byte aligned). The 8 words of padding per row put rows g and
// g + 1 eight banks apart, so a half warp's float2 fragment stores (rows g = 0..3, columns
// 2t, 2t + 1) hit 32 distinct banks; an XOR swizzle would do too, but the bulk op reads plain
// row-major runs.
template <class Words, int kConsumers, int kDqN>
struct Sm90BwdDqStage {
    static constexpr int kRowFloats = kDqN + 8;
    static constexpr int kRowBytes = kDqN * 4;              // one bulk op: a row of this warpgroup's part
    static constexpr int kOffset = Words::kOffset + Words::kBytes;  // 16-byte aligned
    static constexpr int kBytes = kConsumers * 64 * kRowFloats * 4;
    static constexpr int kSmemBytes = kOffset + kBytes + 1024;  // + 1024: base alignment
    static_assert(kRowFloats % 4 == 0 && kRowBytes % 16 == 0, "bulk ops need 16-byte rows");
};

// kDqWriter: the staging tiles of dQ_i in shared memory, past the thread words (or the
// mbarriers), 1024-byte aligned: kBufs (2 where they fit in 227 KB, else 1) tiles of the whole
// BM x kHeadDim fp32 part, each as kHeadDim / 32 column boxes of BM rows x 128 bytes with the
// 128-byte swizzle (16-byte unit u of row r at u ^ (r % 8)), the layout the tensor map tma_dq
// reads one box at a time. Two tiles let the consumers write Q block i + 1's part while the
// bulk op of block i still reads its own.
template <class Words, int kBM, int kHeadDim>
struct Sm90BwdDqWriterStage {
    static constexpr int kOffset = (Words::kOffset + Words::kBytes + 1023) / 1024 * 1024;
    static constexpr int kBoxBytes = kBM * 128;             // 32 fp32 columns of BM rows
    static constexpr int kTileBytes = kBM * kHeadDim * 4;
    static constexpr int kBufs = kOffset + 2 * kTileBytes + 1024 <= 227 * 1024 ? 2 : 1;
    static constexpr int kSmemBytes = kOffset + kBufs * kTileBytes + 1024;  // + 1024: base alignment
};

// kSharedKeys with kDqWriter (head dim 256, where no staging tile fits next to the rest): dQ_i's
// part (BM 64 rows x 256 fp32: 8 boxes of 32 columns, each 64 rows x 128 bytes with the 128-byte
// swizzle, as Sm90BwdDqWriterStage lays a box out) is staged in the ring slot that held Q_i, dO_i,
// once the GEMMs reading them are done. Warpgroup wg's dV_j, dK_j read only column chunks 2wg,
// 2wg + 1 of dO_i, Q_i (its kDkvN = 128 columns), and every warpgroup's Sᵀ, dPᵀ (which read all
// chunks) completed before the barrier that precedes dV, dK: so warpgroup wg stages its 4 boxes
// (dQ columns 128wg..+127) in exactly those chunks, with no barrier between the warpgroups: box
// 4wg + b in Q_i's chunk 2wg + b (b = 0, 1), in dO_i's chunk 2wg + b - 2 (b = 2, 3). The writer
// warp adds the 8 boxes and then releases the slot (q_empty) to the producer.
// kRoles (the warpgroups split by operand, below): warpgroup 0's dV reads all of dO_i, warpgroup 1's
// dK all of Q_i, so warpgroup 0's boxes 0..3 go to dO_i's chunks 0..3 and warpgroup 1's boxes 4..7
// to Q_i's chunks 0..3.
template <class Shape, bool kRoles = false>
struct Sm90BwdSlotDqStage {
    static_assert(Shape::kQChunkBytes == 64 * 128 && Shape::kChunks == 4,
                  "head dim 256, BM 64: a 32-column fp32 box of 64 rows fills one 64-column chunk of Q_i");
    // shared-window address of box `box` (dQ columns 32·box..+31) in the slot at byte offset q_off
    static __device__ __forceinline__ u32 box(u32 smem, u32 q_off, int box) {
        if constexpr (kRoles)
            return smem + (box < 4 ? Shape::kDoOffset : Shape::kQOffset) + q_off + (box % 4) * Shape::kQChunkBytes;
        const int b = box % 4;
        return smem + (b < 2 ? Shape::kQOffset : Shape::kDoOffset) + q_off
               + (2 * (box / 4) + b % 2) * Shape::kQChunkBytes;
    }
};

// Store this thread's part of a 64-column dQ piece into boxes box0, box0 + 1 of the ring slot at q_off
// (Stage: Sm90BwdSlotDqStage), laid out as the kDqWriter tile: the thread's rows warp·16 + g (+ 8),
// columns 8nt + 2t (+ 1) of the piece, the odd rows g storing fragment nt ^ 2 where the others store
// nt (no bank conflicts: see the kDqWriter staging in sm90_bwd_body)
template <class Stage>
__device__ __forceinline__ void store_slot_dq_r2s(unsigned char* smem_ptr, u32 smem, u32 q_off, int box0,
                                                  const float (&dq_part)[32], int warp, int g, int t) {
    const bool odd = g % 2;
    const u32 sw = ((t / 2) ^ g ^ (odd ? 4 : 0)) << 4;
    const u32 row_off = (warp * 16 + g) * 128 + (t % 2) * 8;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const int ns = nt ^ 2;
        unsigned char* box = smem_ptr + (Stage::box(smem, q_off, box0 + nt / 4) - smem);
        const u32 off = row_off + (sw ^ ((2 * (nt % 4)) << 4));
#pragma unroll
        for (int half = 0; half < 2; ++half)
            *reinterpret_cast<float2*>(box + off + half * 8 * 128)
                = make_float2(odd ? dq_part[4 * ns + 2 * half] : dq_part[4 * nt + 2 * half],
                              odd ? dq_part[4 * ns + 2 * half + 1] : dq_part[4 * nt + 2 * half + 1]);
    }
}

// kRoles: a warpgroup's side as a type (the Pᵀ side or the dSᵀ side), so that each side's loop is
// its own straight-line code (no wgmma under a run-time branch)
template <bool kPSide>
struct Sm90BwdSide {
    static constexpr bool value = kPSide;
};

// Byte offset of element (row, col) of a 16-bit tile stored as 64-column chunks of `rows` rows
// with the 128-byte swizzle (16-byte unit u of row r sits at unit u ^ (r % 8)); the tile's base
// is 1024-byte aligned.
__device__ __forceinline__ u32 swizzled_offset(int row, int col, int rows) {
    const int chunk = col / 64, byte = (col % 64) * 2;
    return chunk * rows * 128 + row * 128 + ((((byte >> 4) ^ (row & 7)) << 4) | (byte & 15));
}

// A wgmma shared-memory descriptor (ptx_sm90.cuh smem_desc_sw128) kept as its low 32 bits: the
// high word (SBO = 1024, 128-byte swizzle) is the same constant for every operand here, and the
// k-steps only advance the start address, so the offsets are 32-bit adds (NVRTC otherwise builds
// 64-bit descriptor arithmetic whose extra registers spill the d128 kernel).
struct DescLo {
    static constexpr u32 kHi = (1024u >> 4) | (1u << 30);  // bits 32-45: SBO >> 4; bit 62: 128B swizzle
    u32 lo;
    __device__ __forceinline__ DescLo(u32 addr, u32 lbo_bytes) : lo(((addr & 0x3FFFFu) >> 4) | ((lbo_bytes >> 4) << 16)) {}
    // the descriptor of the operand `bytes` further on
    __device__ __forceinline__ u64 at(u32 bytes) const { return (u64(kHi) << 32) | (lo + (bytes >> 4)); }
};

// A CTA's K/V block and (head, batch) pair (pair = batch · nheads + head).
struct Sm90BwdTile {
    int n_block, pair;
};

// kWideEpi's 16-byte dK / dV stores: the four lanes t = 0..3 of a quad (one accumulator row) hold, for four
// 8-column groups j, the packed pair of columns 2t, 2t + 1 (wgmma's m64nN layout: x[j]). Transposed in the quad
// (two exchanges, lane ^ 1 then lane ^ 2), lane t holds the whole group t, its columns 0..7 in order: one
// 16-byte store a lane instead of four 4-byte ones (a warp's store writes 64 contiguous bytes of each of its
// 8 rows). Every lane of the warp takes part (shfl_sync).
__device__ __forceinline__ void quad_transpose(u32 (&x)[4], int t) {
    const bool odd = t & 1, high = t & 2;
    u32 r0 = __shfl_xor_sync(0xffffffffu, odd ? x[0] : x[1], 1);
    u32 r1 = __shfl_xor_sync(0xffffffffu, odd ? x[2] : x[3], 1);
    if (odd) { x[0] = r0; x[2] = r1; } else { x[1] = r0; x[3] = r1; }
    r0 = __shfl_xor_sync(0xffffffffu, high ? x[0] : x[2], 2);
    r1 = __shfl_xor_sync(0xffffffffu, high ? x[1] : x[3], 2);
    if (high) { x[0] = r0; x[1] = r1; } else { x[2] = r0; x[3] = r1; }
}

// kWideEpi: one accumulator row half (`half`: row g or g + 8 of the lane's quad) of kCols columns, scaled,
// packed and stored 16 bytes a lane at row pointer `row` (columns col0 ..; groups at or past head_dim not
// stored; `inside`: the row is a key inside seqlen_k). Every lane of the warp calls it (quad_transpose).
template <int kCols, class Elem>
__device__ __forceinline__ void store_row_wide(u16* row, const float* acc, int half, float scale, int col0,
                                               int head_dim, bool inside, int t) {
#pragma unroll
    for (int q4 = 0; q4 < kCols / 32; ++q4) {                  // 8-column groups 4·q4 .. 4·q4 + 3
        u32 x[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            x[j] = pack2<Elem>(acc[4 * (4 * q4 + j) + 2 * half] * scale, acc[4 * (4 * q4 + j) + 2 * half + 1] * scale);
        quad_transpose(x, t);
        const int col = col0 + (4 * q4 + t) * 8;               // this lane's group after the exchange
        if (inside && col < head_dim) *reinterpret_cast<u32x4*>(row + col) = u32x4{x[0], x[1], x[2], x[3]};
    }
}

// kWideEpi's condition at run time: MHA with dk, dv 16-byte aligned (pointers; batch / row / head strides in
// whole 8-element groups; head_dim whole 8-column groups)
__device__ __forceinline__ bool wide_epi_fits(const Sm90BwdParams& p) {
    return p.nheads == p.nheads_kv && p.head_dim % 8 == 0
           && ((reinterpret_cast<u64>(p.dk) | reinterpret_cast<u64>(p.dv)) % 16 == 0)
           && ((p.dk_batch_stride | p.dk_row_stride | p.dk_head_stride | p.dv_batch_stride | p.dv_row_stride
                | p.dv_head_stride) % 8 == 0);
}

// kLpt's launch order (blockIdx.x -> tile), fa2_bwd's: the pairs in groups of `group` (the
// params' head_group; the last group may be smaller); groups one after the other, inside one the
// K/V block the slow index from block 0 (under the causal mask the one the most Q blocks see) and
// the pair the fast one. The hardware starts CTAs in blockIdx order, so every group runs its
// longest CTAs first and its short ones fill the tail (longest processing time first), and the
// CTAs running together read a few pairs' Q, dO and dQ accumulator, which stay in L2 (the host
// sizes a group to two waves of CTAs). The plain order (pair slow, K/V block fast) ends the
// launch with the last pair's longest CTAs.
__device__ __forceinline__ Sm90BwdTile sm90_bwd_lpt_tile(int tile, int n_kv, int n_pairs, int group) {
    const int first = tile / (group * n_kv) * group;          // the group's first pair
    const int in_group = tile - first * n_kv;
    const int width = min(group, n_pairs - first);
    return Sm90BwdTile{in_group / width, first + in_group % width};
}

// kDynamic: the CTA's tiles after its first (blockIdx.x) are claimed from a global counter (as
// sm90_fwd's dynamic scheduler: Sm90TileRing there), so a CTA that drew short causal tiles takes
// more of them. The producer warp's lane 0 claims (atomicAdd) right after issuing the last loads of
// its current tile, and hands the index through a ring of 2 shared-memory slots to the takers: the
// consumer threads and, with kDqWriter, the writer warp. `full` (one arrival: the producer's,
// after writing the index; its release makes the write visible to the takers' acquiring wait) and
// `empty` (kTakers arrivals: every taker thread, once it has read the index). A claimed index >=
// n_tiles ends every role's loop (handed over as K/V block -1). The counter's reset: each CTA
// claims until it draws an index past the tiles, so a launch makes exactly n_tiles claims (the
// host launches at most n_tiles CTAs) and draws 0..n_tiles - 1 once each: the CTA that draws
// n_tiles - 1 made the launch's last claim and sets the counter back to 0 for the next launch
// (zeroed once when the plan allocates it, never read by the host: CUDA graphs replay it as is).
// A slot holds the tile decoded (K/V block, pair; n_block -1: none left), so that the takers need
// neither the tile count nor a division. A taker keeps only its count in a register, the producer
// its count in shared memory after the slots (its 24 registers are taken by its loads' state);
// the mbarriers (full[2], empty[2]) and the slots after them are addressed from `bars` at each
// call (the consumers have no register to spare across the tile loop).
template <int kTakers>
struct Sm90BwdTileRing {
    int n = 0;         // tiles taken so far (a taker's)
    static __device__ __forceinline__ u32 full(u32 bars, int slot) { return bars + 8u * slot; }
    static __device__ __forceinline__ u32 empty(u32 bars, int slot) { return bars + 8u * (2 + slot); }
    static __device__ __forceinline__ volatile int* slot_ptr(unsigned char* bars_ptr, int slot) {
        return reinterpret_cast<volatile int*>(bars_ptr + 8 * 4 + 8 * slot);
    }
    static __device__ __forceinline__ volatile int* claims(unsigned char* bars_ptr) {   // tiles handed over
        return reinterpret_cast<volatile int*>(bars_ptr + 8 * 4 + 16);
    }
    static __device__ __forceinline__ void init(u32 bars, unsigned char* bars_ptr) {
        for (int s = 0; s < 2; ++s) {
            mbarrier_init(full(bars, s), 1);
            mbarrier_init(empty(bars, s), kTakers);
        }
        *claims(bars_ptr) = 0;
    }
    // producer (one thread): claim the next tile, decode it (decode(tile) -> Sm90BwdTile) and hand
    // it over (n_block -1: none left)
    template <class Decode>
    static __device__ __forceinline__ Sm90BwdTile claim(u32 bars, unsigned char* bars_ptr, int* counter, int n_tiles,
                                                        Decode decode) {
        const int n = *claims(bars_ptr);
        const int drawn = atomicAdd(counter, 1);
        if (drawn == n_tiles - 1) atomicExch(counter, 0);   // the launch's last claim
        const int tile = grid_ctas() + drawn;
        const Sm90BwdTile at = tile < n_tiles ? decode(u32(tile)) : Sm90BwdTile{-1, 0};
        const int slot = n & 1;
        if (n >= 2) mbarrier_wait(empty(bars, slot), u32((n >> 1) - 1) & 1);
        slot_ptr(bars_ptr, slot)[0] = at.n_block;
        slot_ptr(bars_ptr, slot)[1] = at.pair;
        mbarrier_arrive(full(bars, slot));
        *claims(bars_ptr) = n + 1;
        return at;
    }
    // takers: the next tile the producer handed over (n_block -1: none left)
    __device__ __forceinline__ Sm90BwdTile take(u32 bars, unsigned char* bars_ptr) {
        const int slot = n & 1;
        mbarrier_wait(full(bars, slot), u32(n >> 1) & 1);
        const Sm90BwdTile at{slot_ptr(bars_ptr, slot)[0], slot_ptr(bars_ptr, slot)[1]};
        mbarrier_arrive(empty(bars, slot));
        ++n;
        return at;
    }
};

// kDqConvert (with kDqWriter): fa2_bwd_convert_dq's work (dQ = scale · accumulator) inside the main
// kernel, so that CTAs whose tiles are done (the SMs the dynamic scheduler leaves idle at the end
// of the grid; in the plain grid every CTA at its end) convert the (head, batch) pairs that are
// done while other tiles run, and the backward has no third launch. A pair is done once its n_kv
// K/V tiles' dQ additions have completed: the writer warp counts each tile after its bulk
// reduce-adds, and the count that completes the pair appends its jobs (kRows-row chunks of dQ) to
// queue pair % kQueues; a CTA's consumers, once its tiles are done and its writer has counted the
// last, take jobs off the queues (from queue blockIdx.x % kQueues on: kQueues heads to share out
// the compare-and-swaps, one queue's CTAs retry in turn) and convert them until every queue is
// empty. No CTA waits for another's tiles (only for a queue slot that the thread which reserved it
// is writing, a few instructions on): a job appended after a CTA found the queues empty is taken
// by the CTA that appended it, whose consumers look only after their writer's last count.
// Counters (the plan's zeroed int32 buffer p.tile_counter after the claim counter, all back to 0
// when the launch ends): [1] CTAs that found every queue empty, [2 + 2k], [3 + 2k] queue k's head
// and tail, [2 + 2·kQueues + pair] the pair's tiles done, then queue k's slots from
// kCap · k on (kCap = ceil(n_pairs / kQueues) · n_chunks): the i-th job queued there, plus 1 (0: not
// written yet); a job is pair · n_chunks + chunk. Heads and tails only grow during a launch (no ABA
// for the compare-and-swap); the last CTA to find every queue empty, when no CTA looks at them any
// more, sets them back to 0.
struct Sm90BwdDqQueue {
    static constexpr int kRows = 256;               // dQ rows a job
    static constexpr int kQueues = 16;
    int* c;
    int n_pairs, n_chunks, cap;
    __device__ __forceinline__ Sm90BwdDqQueue(int* counters, int pairs, int seqlen_q)
        : c(counters), n_pairs(pairs), n_chunks((seqlen_q + kRows - 1) / kRows),
          cap((pairs + kQueues - 1) / kQueues * ((seqlen_q + kRows - 1) / kRows)) {}
    __device__ __forceinline__ int* head(int k) const { return c + 2 + 2 * k; }
    __device__ __forceinline__ int* tail(int k) const { return c + 3 + 2 * k; }
    __device__ __forceinline__ int* slot(int k, int i) const { return c + 2 + 2 * kQueues + n_pairs + k * cap + i; }
    // writer lane 0, once the tile's reduce-adds have completed (bulk_wait_group<0>)
    __device__ __forceinline__ void tile_done(int pair, int n_kv) const {
        int* done = c + 2 + 2 * kQueues + pair;
        fence_proxy_async_global();                 // the bulk additions before the count
        __threadfence();
        if (atomicAdd(done, 1) != n_kv - 1) return;
        atomicExch(done, 0);                        // the pair's last count (for the next launch)
        __threadfence();
        const int k = pair % kQueues;
        const int i = atomicAdd(tail(k), n_chunks);
        for (int ch = 0; ch < n_chunks; ++ch) atomicExch(slot(k, i + ch), pair * n_chunks + ch + 1);
    }
    // one consumer thread of each CTA: the next job, -1 once every queue is empty (then the CTA looks
    // no more: the grid's last to get -1 resets the heads, tails and this count)
    __device__ __forceinline__ int pop() const {
        const int k0 = blockIdx.x % kQueues;
        for (int n = 0; n < kQueues;) {
            const int k = k0 + n < kQueues ? k0 + n : k0 + n - kQueues;
            const int h = ld_acquire_gpu(head(k));
            if (h >= ld_acquire_gpu(tail(k))) {
                ++n;                                // (this queue is empty: the next)
                continue;
            }
            if (atomicCAS(head(k), h, h + 1) != h) continue;
            int v;
            while ((v = ld_acquire_gpu(slot(k, h))) == 0) {}   // (its writer is between the atomics)
            atomicExch(slot(k, h), 0);
            __threadfence();
            return v - 1;
        }
        if (atomicAdd(c + 1, 1) == int(gridDim.x) - 1) {
            for (int k = 0; k < kQueues; ++k) {
                atomicExch(head(k), 0);
                atomicExch(tail(k), 0);
            }
            atomicExch(c + 1, 0);
        }
        return -1;
    }
};

// dQ[batch, rows, head, :] = scale · dq_accum[bh, rows] of one job (Sm90BwdDqQueue) by `threads`
// threads (thread `tid` of them): fa2_bwd_convert_dq's arithmetic, 8 columns a thread per item, in
// batches of kBatch items whose loads are all issued before the first store (a few SMs convert
// what a grid of its own did: 32 KB in flight per thread group keeps the latency covered); the
// accumulator read through L2 (ld.global.cg: other SMs' additions)
template <class Elem>
__device__ __forceinline__ void sm90_bwd_convert_dq_job(const Sm90BwdParams& p, const Sm90BwdDqQueue& queue,
                                                        int job, int tid, int threads) {
    constexpr int kBatch = 8;
    const int pair = job / queue.n_chunks, row0 = (job % queue.n_chunks) * Sm90BwdDqQueue::kRows;
    const int head = pair % p.nheads, batch = pair / p.nheads;
    const int chunks = p.head_dim / 8;
    const float* acc_rows = p.dq_accum + (static_cast<i64>(pair) * p.seqlen_q_rounded + row0) * p.head_dim_rounded;
    u16* dq = static_cast<u16*>(p.dq) + batch * p.dq_batch_stride + row0 * p.dq_row_stride + head * p.dq_head_stride;
    const int n = min(Sm90BwdDqQueue::kRows, p.seqlen_q - row0) * chunks;
    for (int base = tid; base < n; base += kBatch * threads) {
        float4 a[kBatch][2];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
            const int idx = base + b * threads;
            if (idx < n) {
                const float4* acc = reinterpret_cast<const float4*>(
                    acc_rows + static_cast<i64>(idx / chunks) * p.head_dim_rounded + (idx % chunks) * 8);
                a[b][0] = __ldcg(acc);
                a[b][1] = __ldcg(acc + 1);
            }
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
            const int idx = base + b * threads;
            if (idx < n) {
                u32x4 out;
                out.x = pack2<Elem>(a[b][0].x * p.softmax_scale, a[b][0].y * p.softmax_scale);
                out.y = pack2<Elem>(a[b][0].z * p.softmax_scale, a[b][0].w * p.softmax_scale);
                out.z = pack2<Elem>(a[b][1].x * p.softmax_scale, a[b][1].y * p.softmax_scale);
                out.w = pack2<Elem>(a[b][1].z * p.softmax_scale, a[b][1].w * p.softmax_scale);
                *reinterpret_cast<u32x4*>(dq + static_cast<i64>(idx / chunks) * p.dq_row_stride + (idx % chunks) * 8) = out;
            }
        }
    }
}

// kDqTail (with kDqWriter on the dynamic scheduler): the dQ convert stays a kernel of its own,
// sm90_bwd_dq_tail below, launched as a programmatic dependent of the main kernel (cuflash.launch:
// LaunchSpec pdl), which lets it be scheduled as soon as every main CTA has started. Its CTAs (two
// an SM; none fits beside a main CTA) take the SMs the dynamic scheduler leaves idle at the end of
// the grid and convert every (head, batch) pair whose K/V tiles are all done while the last tiles
// still run, instead of after the whole grid. The main kernel's writer warp counts each tile of a
// pair once its bulk reduce-adds have completed (the words below, in the plan's zeroed int32 buffer
// p.tile_counter after the claim counter); the convert kernel's CTAs draw jobs (kRows rows of one
// pair, pair-major: the order in which the scheduler finishes them) by ticket and wait for their
// pair's count. Its last CTA sets the words back to 0 for the next launch.
struct Sm90BwdDqTail {
    static constexpr int kThreads = 256, kCtasPerSm = 2;    // (sm90_bwd_convert_dq_job's 8 items a thread)
    static constexpr int kTicket = 1, kFinished = 2, kPairCount0 = 3;   // p.tile_counter's words
};

// The kernel's body (sm90_bwd, and sm90_bwd_cluster for kCluster, below, are its entry points).
// kCluster (head dim 256 only): the two CTAs of a cluster (__cluster_dims__(2, 1, 1)) own K/V
// blocks 2c and 2c + 1 of one (head, batch) and walk the same Q blocks (under the causal mask from
// block 2c's first: block 2c + 1 computes one fully hidden block more, P = 0); each CTA's producer
// loads half of Q_i's and dO_i's column chunks (chunks 2·rank, + 1) by multicast into both CTAs'
// slot, and a slot is refilled once both CTAs have released it (q_empty counts the local releases
// and the partner's remote ones; none for a CTA's last kStages Q blocks, which nothing refills,
// so that no arrival reaches a CTA that has finished). The grid has an even number of K/V blocks
// per (head, batch): a CTA past seqlen_k computes with every key hidden and stores nothing.
template <int kBM, int kBN, int kStages, int kConsumers, int kHeadDim, class Elem, bool kCausal,
          bool kDeterministic, bool kWindow, bool kSoftcap, bool kAlibi, bool kDropout, bool kDqBulk,
          bool kOverlapSdp, bool kDqWriter, bool kVarlen, bool kLpt, bool kDynamic, bool kDsDouble, bool kCluster,
          bool kSAhead, bool kDqEarly, bool kQRotate, bool kDkLate, bool kFragPin, bool kRoles, bool kDqConvert,
          bool kDqFirst, bool kWideEpi = false, int kDropPacked = 0, int kCapFold = 0, int kDqTail = 0>
__device__ __forceinline__ void sm90_bwd_body(const Sm90BwdParams& p) {
    using Shape = Sm90BwdShape<kBM, kBN, kStages, kConsumers, kHeadDim, kDynamic, kDsDouble ? 2 : 1>;
    using Mask = CausalMask<kCausal>;
    // softcap's words 0 .. BM/4 - 1, then dropout's (Sm90BwdThreadWords)
    // (kSharedKeys: kSN = BM / 2 queries a warpgroup, and the words stay in registers)
    constexpr bool kSharedKeys = Shape::kSharedKeys;
    constexpr int kSN = Shape::kSN, kDkvN = Shape::kDkvN;
    constexpr int kCapWord0 = 0, kPWord0 = kSoftcap ? kSN / 4 : 0;
    constexpr int kWordCount = (int(kSoftcap) + int(kDropout)) * kSN / 4;
    // kCapFold: the t of a hidden element of Pᵀ, finite so that its word Pᵀ ∘ (1 - t²) is 0 · (1 - 10³⁶) =
    // 0 (-inf would give NaN there), and large so that exp2(t·softcap·log2e - LSE·log2e) is 0 for any
    // softcap above 10⁻¹⁶
    constexpr float kCapHiddenT = -1e18f;
    using Words = Sm90BwdThreadWords<Shape, kConsumers, kSharedKeys ? 0 : kWordCount>;
    static_assert(!(kSoftcap || kDropout) || Words::kSmemBytes <= 227 * 1024,
                  "softcap / dropout: shared memory exceeds the H100's 227 KB");
    using DqStage = Sm90BwdDqStage<Words, kConsumers, Shape::kDqN>;
    static_assert(!kDqBulk || DqStage::kSmemBytes <= 227 * 1024, "dq_bulk: shared memory exceeds the H100's 227 KB");
    static_assert(!(kDqBulk && kDeterministic), "dq_bulk is the unordered mode's: deterministic keeps its ordered red.add");
    using DqW = Sm90BwdDqWriterStage<Words, kBM, kHeadDim>;
    static_assert(!kDqWriter || kSharedKeys || DqW::kSmemBytes <= 227 * 1024,
                  "dq_writer: shared memory exceeds the H100's 227 KB");
    // kSharedKeys with kDqWriter: dQ_i's part is staged in the ring slot of Q_i, dO_i (no tile of
    // its own: Sm90BwdSlotDqStage), the writer warp releases the slot too (q_empty: one arrival
    // more than the consumer threads')
    // (2 stages: the consumers reach Q block q + 2, and its barrier parity again, only once the
    // writer has released Q block q's slot)
    // (kDynamic: the parity of the CTA's Q block count, which runs on across its tiles)
    static_assert(!(kSharedKeys && kDqWriter) || (kStages == 2 && !kDeterministic),
                  "shared keys with dq_writer: 2 stages (the writer's barriers by parity), unordered");
    static_assert(!(kSharedKeys && kDynamic) || kRoles, "kDynamic at head dim 256: with kRoles only");
    constexpr bool kSlotDq = kSharedKeys && kDqWriter;
    static_assert(!kCluster || (kSharedKeys && !kWindow && !kVarlen && !kDeterministic && !kDynamic && !kLpt),
                  "kCluster: the head-dim-256 tile, fixed lengths, no window, unordered, the plain order");
    static_assert(!kRoles || (kSharedKeys && !kDeterministic && !kWindow && !kSoftcap && !kAlibi && !kDropout
                              && !kVarlen && !kOverlapSdp),
                  "kRoles: the head-dim-256 tile's plain unordered backward (fixed lengths, no feature)");
    static_assert(!(kSAhead && kSharedKeys) || kRoles, "s_ahead at head dim 256: with roles only");
    static_assert(!(kLpt && kVarlen), "lpt orders fixed-length grids (varlen keeps the plain order)");
    static_assert(!kWideEpi || !(kVarlen || kDeterministic || kAlibi || (kDropout && !kDropPacked) || kCluster),
                  "kWideEpi: the plain, windowed or softcapped fixed-length unordered backward, or dropout with "
                  "kDropPacked (no other feature, no cluster)");
    static_assert(kDropPacked >= 0 && kDropPacked <= 3
                  && (!kDropPacked || (kDropout && !kSharedKeys && !kDeterministic && !kWindow && !kSoftcap && !kAlibi)),
                  "kDropPacked (0..3): dropout alone on the head dim 64 / 128 tiles, unordered (dropout_transposed.cuh)");
    static_assert(kCapFold >= 0 && kCapFold <= 3 && (!kCapFold || (kSoftcap && !kAlibi && !kDropout)),
                  "kCapFold (0..3): softcap without ALiBi or dropout (its word is Pᵀ ∘ (1 - tanh²))");
    static_assert(!(kDynamic && (kVarlen || kDeterministic)),
                  "the dynamic scheduler runs fixed-length, unordered backwards");
    static_assert(!(kQRotate && (kCausal || kWindow || kDeterministic || kSharedKeys)),
                  "q_rotate: the unmasked, unordered backward of the head dim 64 / 128 tiles");
    static_assert(!kDkLate || (kDqEarly && kDqWriter && !kSAhead),
                  "dk_late: with dq_early and dq_writer (its dK GEMM is waited for after the dQ staging), "
                  "not with s_ahead");
    static_assert(!((kSAhead || kDqEarly) && ((kSharedKeys && !kRoles) || kOverlapSdp)) && !(kDqEarly && kSharedKeys),
                  "s_ahead / dq_early: the head dim 64 / 128 tiles (s_ahead: and roles), not with overlap_sdp");
    static_assert(!kDqConvert || (kDqWriter && !kVarlen && !kDeterministic && !kCluster),
                  "dq_convert: with dq_writer (its counts follow the writer's bulk additions), fixed lengths, "
                  "unordered, one CTA a cluster");
    static_assert(!kDqFirst || (kDqWriter && !kVarlen && !kDeterministic && !kCluster && kBM % 64 == 0),
                  "dq_first: with dq_writer (its warp zeroes the Q blocks' rows), fixed lengths, unordered, one "
                  "CTA a cluster, BM 64 or 128 (whole Q blocks within the padded rows)");
    static_assert(kDqTail >= 0 && kDqTail <= 2
                  && (!kDqTail || (kDqWriter && kDynamic && !kDqConvert && !kVarlen && !kDeterministic && !kCluster)),
                  "dq_tail (0..2): with dq_writer on the dynamic scheduler (its writer counts every tile), fixed "
                  "lengths, unordered, not with dq_convert");
    static_assert(!(kDqWriter && (kDeterministic || kDqBulk)),
                  "dq_writer is the unordered mode's (deterministic keeps red.add), and not with dq_bulk");
    // BM 80 (head dim 128, 2 consumers; FA3's non-causal tile): 80 queries are not a whole wgmma m
    // (64), so the dQ part is computed transposed, dQ_iᵀ = K_jᵀ dSᵀ (m = this warpgroup's 64 head-dim
    // columns, n = the 80 queries), and staged transposed into dq_writer's tile
    constexpr bool kDqSwap = kBM % 64 != 0;
    static_assert(!kDqSwap || (kDqWriter && !kCausal && !kWindow && !kVarlen && !kDeterministic && !kDynamic
                               && !kSoftcap && !kAlibi && !kDropout && !kOverlapSdp && !kSAhead && !kQRotate
                               && !kCluster),
                  "BM 80: non-causal, fixed lengths, unordered, dq_writer, no feature, the plain grid, "
                  "not with overlap_sdp / s_ahead / q_rotate");
    // kDqWriter's named barriers (consumer threads + the writer warp): tile b full, tile b free
    constexpr int kDqFullBar = 2, kDqEmptyBar = 4, kDqBarThreads = kConsumers * 128 + 32;
    // kDqConvert: the writer's last tile counted (consumers + writer), the queue's pair read (consumers)
    constexpr int kConvBar = 11, kConvPairBar = 12;
    constexpr int kChunks = Shape::kChunks;
    constexpr int kConsumerThreads = kConsumers * 128;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char* smem_ptr = smem_raw + (smem - smem_u32(smem_raw));
    const u32 k_smem = smem, v_smem = smem + Shape::kVOffset;
    const u32 q_smem = smem + Shape::kQOffset, do_smem = smem + Shape::kDoOffset;
    const u32 ds_smem = smem + Shape::kDsOffset;
    const u32 lse_smem = smem + Shape::kLseOffset, D_smem = smem + Shape::kDOffset;
    const float* lse_smem_f = reinterpret_cast<const float*>(smem_ptr + Shape::kLseOffset);
    const float* D_smem_f = reinterpret_cast<const float*>(smem_ptr + Shape::kDOffset);
    unsigned char* ds_smem_ptr = smem_ptr + Shape::kDsOffset;
    const u32 bars = smem + Shape::kBarOffset;
    const u32 kv_full = bars;
    auto q_full = [&](int slot) { return bars + 8u * (1 + slot); };
    auto q_empty = [&](int slot) { return bars + 8u * (1 + kStages + slot); };
    // kDynamic: kv_empty (every consumer thread, once its last GEMM of the tile that reads K_j or V_j
    // has completed: the next tile's K_j, V_j may load), the tile ring, dq_writer's tile-free
    // barriers (mbarriers here, one arrival: the writer's, once the bulk op has read the tile; an
    // arrival that no wait follows is harmless, unlike a named barrier's at the end of the CTA)
    const u32 kv_empty = bars + 8u * (1 + 2 * kStages);
    using Ring = Sm90BwdTileRing<kConsumers * 128 + (kDqWriter ? 32 : 0) + (kDqFirst ? 32 : 0)>;   // (its takers)
    Ring ring;
    constexpr int kRingOffset = Shape::kBarOffset + 8 * (4 + 2 * kStages);   // its 4 mbarriers, then 2 slots
    static_assert(!kDynamic || kRingOffset + 8 * 4 + 24 == Shape::kBarEnd, "the ring's slots end the barrier area");
    auto ring_take = [&]() { return ring.take(smem + kRingOffset, smem_ptr + kRingOffset); };
    auto dq_empty = [&](int buf) { return bars + 8u * (2 + 2 * kStages + buf); };

    const int tid = threadIdx.x, warpgroup = tid / 128;
    const int n_kv = (p.seqlen_k + kBN - 1) / kBN;
    const int n_tiles = n_kv * p.batch * p.nheads;
    // kCluster: the grid's K/V blocks per (head, batch), even (a CTA past seqlen_k stores nothing)
    const int n_kv_grid = kCluster ? (n_kv + 1) & ~1 : n_kv;
    // The tile's K/V block and (head, batch): blockIdx.x's, and with kDynamic each claimed one's
    // (enter_tile, then tile_range below, in every role)
    int n_block, pair, head, batch, head_kv, key0;
    i64 bh;
    auto decode = [&](u32 tile) {       // (unsigned: the plain kernel's blockIdx.x arithmetic)
        return kLpt ? sm90_bwd_lpt_tile(tile, n_kv, p.batch * p.nheads, p.head_group)
                    : Sm90BwdTile{int(tile % n_kv_grid), int(tile / n_kv_grid)};
    };
    auto enter_tile = [&](Sm90BwdTile at) {
        n_block = at.n_block;
        pair = at.pair;
        head = pair % p.nheads;
        batch = pair / p.nheads;
        head_kv = head / (p.nheads / p.nheads_kv);           // GQA / MQA
        bh = static_cast<i64>(batch) * p.nheads + head;
        key0 = n_block * kBN;
    };
    enter_tile(decode(blockIdx.x));
    // kVarlen: this sequence's rows and lengths (varlen.cuh). Its lengths replace the params'
    // (seqlen_q, seqlen_k: the longest) wherever they are read; fixed lengths read the params
    // as before (every varlen expression is a compile-time branch: the plain kernel's code is
    // unchanged). A K/V block past the sequence's end has nothing to compute or store.
    const SeqSpan seq = seq_span<kVarlen>(p, batch);
    if constexpr (kVarlen)
        if (key0 >= seq.seqlen_k) return;
    // first row of (batch, head) in the fp32 workspace (lse_log2, D; dq_accum in rows of
    // head_dim_rounded floats); kVarlen: within head `head`'s ws_rows rows (for tma_dq)
    // kDqFirst: the ticket of Q block m_block of this tile's pair (fixed lengths: pair is bh)
    auto dq_ticket = [&](int m_block) { return p.dq_semaphore + pair * (p.seqlen_q_rounded / 16) + m_block; };
    auto ws_row0 = [&]() -> i64 {
        return kVarlen ? ws_row_offset<kVarlen>(p, batch, head, seq) : bh * p.seqlen_q_rounded;
    };

    // Q blocks that see K_j: all, or under the causal mask those from q_block_begin on; under a
    // window (kWindow: the band mask, mask.cuh BandMask) [q_block_begin, q_block_end) of the band.
    const Mask mask(kVarlen ? seq.seqlen_q : p.seqlen_q, kVarlen ? seq.seqlen_k : p.seqlen_k);
    const BandMask<kCausal, kWindow> band(kVarlen ? seq.seqlen_q : p.seqlen_q, kVarlen ? seq.seqlen_k : p.seqlen_k,
                                          p.window_left, p.window_right);
    const int m_blocks = ((kVarlen ? seq.seqlen_q : p.seqlen_q) + kBM - 1) / kBM;
    int m_block_min, n_iters;
    // kQRotate (no mask: every K/V block sees every Q block): K/V block n visits the Q blocks from
    // n % n_iters on, wrapping around, so that the CTAs of a (head, batch), which run side by side,
    // read different Q blocks and add into different dQ rows at any time (from block 0 they all
    // add into the same rows at once). The order of a CTA's additions does not change dK_j, dV_j's
    // sums' terms, only their order.
    int q_rot = 0;
    auto tile_range = [&]() {
        // (kCluster: the cluster's first K/V block's Q blocks, the same for both CTAs)
        m_block_min = kWindow ? band.template q_block_begin<kBM>(key0)
                              : mask.template q_block_begin<kBM>(kCluster ? (n_block & ~1) * kBN : key0);
        const int m_block_end = kWindow ? band.template q_block_end<kBM, kBN>(key0, m_blocks) : m_blocks;
        n_iters = max(0, m_block_end - m_block_min);
        if constexpr (kQRotate) q_rot = n_iters > 0 ? n_block % n_iters : 0;
    };
    tile_range();
    // kDynamic with kRoles: after a tile of n_iters Q blocks (q_done: the CTA's Q blocks before it, counted on),
    // the next tile from the ring, entered (false: none left); the other roles' loops write it out
    auto take_next_tile = [&](int& q_done) {
        q_done += n_iters;
        const Sm90BwdTile next = ring_take();
        if (next.n_block < 0) return false;
        enter_tile(next);
        tile_range();
        return true;
    };
    // the Q block of the tile's it-th iteration
    auto m_block_at = [&](int it) {
        if constexpr (kQRotate) {
            const int m = it + q_rot;
            return m >= n_iters ? m - n_iters : m;
        } else {
            return m_block_min + it;
        }
    };

    if (tid == 0) {
        prefetch_tensormap(&p.tma_q);
        prefetch_tensormap(&p.tma_k);
        prefetch_tensormap(&p.tma_v);
        prefetch_tensormap(&p.tma_do);
        if constexpr (kDqWriter) prefetch_tensormap(&p.tma_dq);
        mbarrier_init(kv_full, 1);
        for (int s = 0; s < kStages; ++s) {
            // lane 0's expect_tx, the 32 lanes' LSE / D (kDynamic: lane 0's alone, LSE / D by bulk copies)
            mbarrier_init(q_full(s), kDynamic ? 1 : 1 + 32);
            // every consumer thread releases, once its last read of the slot (Q_i, dO_i, LSE_i, D_i)
            // is done (kSlotDq: and the writer warp's lane 0, once dQ_i's part, staged in the slot,
            // has been read: the consumers' own arrivals order their LSE / D reads before the
            // producer's cp.async refill directly, not through the writer's named barrier)
            // (kCluster: the partner CTA's releases too)
            mbarrier_init(q_empty(s), (kConsumerThreads + (kSlotDq ? 1 : 0)) * (kCluster ? 2 : 1));
        }
        if constexpr (kDynamic) {
            mbarrier_init(kv_empty, kConsumerThreads);
            Ring::init(smem + kRingOffset, smem_ptr + kRingOffset);
            for (int b = 0; b < 2; ++b) mbarrier_init(dq_empty(b), 1);
        }
        fence_mbarrier_init();                                  // visible to TMA's complete_tx
    }
    __syncthreads();
    // kDqTail: sm90_bwd_dq_tail (the stream's next kernel, a programmatic dependent) may be scheduled
    // now; its CTAs take the SMs this grid's CTAs leave (one CTA an SM here: none fits beside it)
    if constexpr (kDqTail) launch_dependents();
    if constexpr (kCluster) cluster_sync();     // both CTAs' barriers initialised before any multicast

    if (warpgroup == 0) {
        // ---- producer: warp 0; lane 0 issues the TMA copies ----
        setmaxnreg_dec<Shape::kProducerRegs>();
        if (kDqWriter && tid / 32 == 1 && (kDynamic || kDqConvert || n_iters > 0)) {   // (kDqConvert: every tile counts)
            // ---- dQ writer (warp 1): per Q block, once the consumers have staged dQ_i's part in
            // tile q % kBufs (q: the CTA's Q blocks so far; barrier kDqFullBar + tile), lane 0 adds
            // it to the accumulator by kHeadDim / 32 tensor bulk reduce-adds (one per 32-column box;
            // rows past seqlen_q land in the accumulator's padding: its rows are padded to
            // seqlen_q_rounded, a multiple of 128 >= BM, and their values are zeros since their Pᵀ
            // is), waits until the engine has read the tile, and hands it back (kDqEmptyBar + tile;
            // kDynamic: the mbarrier dq_empty(tile)). The accumulator's additions go on in the
            // background while the consumers compute.
            const bool leader = tid == 32;                      // the warp's lane 0
            int q_done = 0;                                     // kDynamic: Q blocks of earlier tiles
            // kDqTail: a tile of `pr` counted once its bulk additions have completed (Sm90BwdDqTail); form 2
            // counts a tile behind the next tile's first Q block (tail_pending: its pair, -1 none), so that
            // the writer does not wait for the engine at the tile boundary
            int tail_pending = -1;
            auto tail_count = [&](int pr) {
                fence_proxy_async_global();                     // the bulk additions before the count
                __threadfence();
                atomicAdd(p.tile_counter + Sm90BwdDqTail::kPairCount0 + pr, 1);
            };
            for (;;) {
                for (int it = 0; it < n_iters; ++it) {
                    const int q = kDynamic ? q_done + it : it;
                    // kSlotDq: barriers by parity (the consumers may arrive for Q block q + 1 before
                    // this warp has waited for q; not for q + 2, whose slot this warp releases)
                    const int buf = kSlotDq ? q & 1 : DqW::kBufs == 1 ? 0 : q % 2;
                    named_barrier_sync(kDqFullBar + buf, kDqBarThreads);
                    if (leader) {
                        const u32 tile = smem + DqW::kOffset + buf * DqW::kTileBytes;
                        const u32 slot_off = kSlotDq ? u32(q % kStages) * Shape::kQBytes : 0u;
                        const int row0 = m_block_at(it) * kBM;
                        if constexpr (kDqFirst) {   // the Q block's rows zeroed (warp 2's zero_rows, here or in another CTA)
                            while (ld_acquire_gpu(dq_ticket(m_block_at(it))) != 2) {}
                            fence_proxy_async_global();         // the zeros before these additions
                        }
#pragma unroll
                        for (int b = 0; b < kHeadDim / 32; ++b) {
                            u32 src = tile + b * DqW::kBoxBytes;
                            if constexpr (kSlotDq) src = Sm90BwdSlotDqStage<Shape, kRoles>::box(smem, slot_off, b);
                            if constexpr (kVarlen)   // the map's rows: (nheads, ws_rows), head `head`'s
                                bulk_reduce_add_tensor_3d(&p.tma_dq, src, 32 * b,
                                                          static_cast<int>(ws_row0() - i64(head) * p.ws_rows) + row0, head);
                            else
                                bulk_reduce_add_tensor_3d(&p.tma_dq, src, 32 * b, row0, pair);
                        }
                        bulk_commit_group();
                        bulk_wait_group_read<0>();              // the tile may be rewritten
                        if constexpr (kDynamic) mbarrier_arrive(dq_empty(buf));
                        if constexpr (kDqTail == 2) {           // the last tile's groups: all but this one
                            if (tail_pending >= 0) {
                                bulk_wait_group<1>();
                                tail_count(tail_pending);
                                tail_pending = -1;
                            }
                        }
                        if constexpr (kSlotDq) mbarrier_arrive(q_empty(q % kStages));   // the slot may be refilled
                        if constexpr (kSlotDq && kCluster)                               // (by the partner too)
                            if (it + kStages < n_iters)
                                mbarrier_arrive_remote(mapa_shared(q_empty(q % kStages), cluster_ctarank() ^ 1u));
                    }
                    __syncwarp();
                    // the consumers wait for tile buf again only if they have a Q block it + kBufs
                    if (!kSlotDq && !kDynamic && it + DqW::kBufs < n_iters)
                        named_barrier_arrive(kDqEmptyBar + buf, kDqBarThreads);
                }
                if constexpr (kDqConvert) {                    // the tile's additions complete: count it
                    if (leader) {
                        bulk_wait_group<0>();
                        Sm90BwdDqQueue(p.tile_counter, p.batch * p.nheads, p.seqlen_q).tile_done(pair, n_kv);
                    }
                    __syncwarp();
                }
                if constexpr (kDqTail == 1) {                  // the tile's additions complete: count it
                    if (leader) {
                        bulk_wait_group<0>();
                        tail_count(pair);
                    }
                    __syncwarp();
                }
                if constexpr (kDqTail == 2) {                  // counted behind the next tile's first Q block
                    if (leader) {
                        if (tail_pending >= 0) {                // (a tile without Q blocks in between)
                            bulk_wait_group<0>();
                            tail_count(tail_pending);
                        }
                        tail_pending = pair;
                    }
                    __syncwarp();
                }
                if constexpr (!kDynamic) break;
                q_done += n_iters;
                const Sm90BwdTile next = ring_take();
                if (next.n_block < 0) break;
                enter_tile(next);
                tile_range();
            }
            if (leader) bulk_wait_group<0>();                   // the additions done before the CTA ends
            if constexpr (kDqTail == 2)
                if (leader && tail_pending >= 0) tail_count(tail_pending);
            if constexpr (kDqConvert) named_barrier_arrive(kConvBar, kConsumerThreads + 32);   // last tile counted
        } else if (kDqFirst && tid / 32 == 2 && (kDynamic || n_iters > 0)) {
            // ---- kDqFirst's zeroing warp (warp 2): the accumulator is not zeroed by the preprocess;
            // the first CTA to reach a Q block zeroes its rows. The Q block's ticket (dq_semaphore[pair]
            // [m_block], zeroed by the preprocess): 0 untouched, 1 being zeroed, 2 zeroed. This warp goes
            // through its tile's Q blocks in order (kDynamic: every tile it takes, as the writer),
            // takes each ticket 0 -> 1 by compare-and-swap, and the winner's 32 lanes store the zeros,
            // fence, and lane 0 publishes 2. The writers wait for 2 before their reduce-adds: long set
            // by then (this warp does no other work, the first addition follows a Q block's compute),
            // and a ticket at 1 is in a zeroing that waits for nothing.
            const int lane = tid % 32;
            for (;;) {
                for (int it = 0; it < n_iters; ++it) {
                    const int m_block = m_block_at(it);
                    int won = lane == 0 ? int(atomicCAS(dq_ticket(m_block), 0, 1) == 0) : 0;
                    if (__shfl_sync(0xffffffffu, won, 0)) {
                        float4* rows = reinterpret_cast<float4*>(p.dq_accum)
                                       + (i64(pair) * p.seqlen_q_rounded + m_block * kBM) * (kHeadDim / 4);
                        for (int i = lane; i < kBM * kHeadDim / 4; i += 32) rows[i] = make_float4(0.f, 0.f, 0.f, 0.f);
                        __threadfence();
                        __syncwarp();
                        if (lane == 0) atomicExch(dq_ticket(m_block), 2);
                    }
                }
                if constexpr (!kDynamic) break;
                const Sm90BwdTile next = ring_take();
                if (next.n_block < 0) break;
                enter_tile(next);
                tile_range();
            }
        } else if (tid < 32 && (kDynamic || n_iters > 0)) {
            const int lane = tid;
            if (kDynamic && lane > 0) return;                  // kDynamic: lane 0 issues everything
            // K_j, V_j (one barrier, kv_full); kDynamic: the tile's first K/V load waits for the
            // consumers to have released the last tile's (kv_empty, the (n - 1)-th release)
            auto load_kv = [&]() {
                if (lane == 0) {
                    mbarrier_arrive_expect_tx(kv_full, 2 * Shape::kKVBytes);
#pragma unroll
                    for (int c = 0; c < kChunks; ++c) {
                        // kVarlen: rows of the packed tensors (batch extent 1)
                        const int kv_row = kVarlen ? seq.k_start + key0 : key0, kv_batch = kVarlen ? 0 : batch;
                        tma_load_4d(k_smem + c * Shape::kKVChunkBytes, &p.tma_k, kv_full, c * 64, kv_row, head_kv, kv_batch);
                        tma_load_4d(v_smem + c * Shape::kKVChunkBytes, &p.tma_v, kv_full, c * 64, kv_row, head_kv, kv_batch);
                    }
                }
            };
            if constexpr (!kDynamic) load_kv();
            int q_done = 0, kv_loads = 0;                       // kDynamic: Q blocks, K/V loads of earlier tiles
            for (;;) {
                const float* lse_rows = p.lse_log2 + (kVarlen ? ws_row0() : bh * p.seqlen_q_rounded);
                const float* D_rows = p.D + (kVarlen ? ws_row0() : bh * p.seqlen_q_rounded);
                for (int it = 0; it < n_iters; ++it) {
                    // q: the CTA's Q block count, the ring position (slot, fill)
                    const int q = kDynamic ? q_done + it : it;
                    const int slot = q % kStages, row0 = m_block_at(it) * kBM;
                    if (q >= kStages) mbarrier_wait(q_empty(slot), u32(q / kStages - 1) & 1);
                    if (lane == 0) {
                        // kDynamic: LSE_i, D_i's bytes too (bulk copies below)
                        mbarrier_arrive_expect_tx(q_full(slot), Shape::kSlotBytes + (kDynamic ? 2 * kBM * 4 : 0));
#pragma unroll
                        for (int c = 0; c < kChunks; ++c) {
                            const int off = slot * Shape::kQBytes + c * Shape::kQChunkBytes;
                            const int q_row = kVarlen ? seq.q_start + row0 : row0, q_batch = kVarlen ? 0 : batch;
                            if constexpr (kCluster) {
                                // this CTA's half of the chunks, into both CTAs of the cluster
                                if (u32(c / (kChunks / 2)) == cluster_ctarank()) {
                                    tma_load_4d_multicast(q_smem + off, &p.tma_q, q_full(slot), c * 64, q_row, head,
                                                          q_batch, 3);
                                    tma_load_4d_multicast(do_smem + off, &p.tma_do, q_full(slot), c * 64, q_row, head,
                                                          q_batch, 3);
                                }
                            } else {
                                tma_load_4d(q_smem + off, &p.tma_q, q_full(slot), c * 64, q_row, head, q_batch);
                                tma_load_4d(do_smem + off, &p.tma_do, q_full(slot), c * 64, q_row, head, q_batch);
                            }
                        }
                    }
                    if constexpr (kDynamic) {
                        // after the tile's first Q_i, dO_i (their slot frees a Q block earlier than
                        // K_j, V_j do): K_j, V_j once the last tile's are released
                        if (it == 0) {
                            if (kv_loads > 0) mbarrier_wait(kv_empty, u32(kv_loads - 1) & 1);
                            load_kv();
                            ++kv_loads;
                        }
                    }
                    // LSE_i then D_i, 4 floats a chunk; the workspace rows are padded to
                    // seqlen_q_rounded (a multiple of BM), so every chunk is valid
                    if constexpr (kDynamic) {
                        // one bulk copy each (the rows start 256-byte aligned: row0 is a multiple
                        // of 64), onto q_full
                        bulk_load_g2s(lse_smem + slot * kBM * 4, lse_rows + row0, kBM * 4, q_full(slot));
                        bulk_load_g2s(D_smem + slot * kBM * 4, D_rows + row0, kBM * 4, q_full(slot));
                        continue;
                    } else if constexpr (kDqWriter) {
                        // the same copies, written with lane < 32 explicit: next to the writer warp's
                        // loop the general form spills under the producer's 24 registers
#pragma unroll
                        for (int k = 0; k < (kDqSwap ? (kBM / 2 + 31) / 32 : kBM / 64); ++k) {
                            const int c = lane + 32 * k;
                            const bool is_D = c >= kBM / 4;
                            const int chunk = is_D ? c - kBM / 4 : c;
                            if constexpr (kDqSwap) {
                                // BM 80: 40 chunks; a Q block may end past the pair's padded rows
                                // (seqlen_q_rounded, a multiple of 128): those chunks zero-filled
                                // (LSE 0, D 0: with Q_i, dO_i's zero rows there, Pᵀ ∘ dO, dSᵀ Q, dS
                                // stay finite and add nothing to dK, dV; their dQ rows are clipped)
                                if (c < kBM / 2)
                                    cp_async_16((is_D ? D_smem : lse_smem) + slot * kBM * 4 + chunk * 16,
                                                (is_D ? D_rows : lse_rows) + row0 + 4 * chunk,
                                                row0 + 4 * chunk < p.seqlen_q_rounded);
                            } else {
                                cp_async_16((is_D ? D_smem : lse_smem) + slot * kBM * 4 + chunk * 16,
                                            (is_D ? D_rows : lse_rows) + row0 + 4 * chunk);
                            }
                        }
                    } else {
                        for (int c = lane; c < kBM / 2; c += 32) {
                            const bool is_D = c >= kBM / 4;
                            const int chunk = is_D ? c - kBM / 4 : c;
                            cp_async_16((is_D ? D_smem : lse_smem) + slot * kBM * 4 + chunk * 16,
                                        (is_D ? D_rows : lse_rows) + row0 + 4 * chunk);
                        }
                    }
                    cp_async_commit();
                    cp_async_wait<0>();
                    mbarrier_arrive(q_full(slot));
                }
                if constexpr (!kDynamic) break;
                q_done += n_iters;
                const Sm90BwdTile next = Ring::claim(smem + kRingOffset, smem_ptr + kRingOffset, p.tile_counter,
                                                     n_tiles, decode);   // (lane 0 alone)
                if (next.n_block < 0) break;
                enter_tile(next);
                tile_range();
            }
        }
        return;
    }

    // ---- consumers ----
    setmaxnreg_inc<Shape::kConsumerRegs>();
    const int wg = warpgroup - 1;                               // keys 64·wg..64·wg+63 of K_j
    const int ctid = tid - 128;                                 // 0..kConsumerThreads-1
    const int warp = (tid / 32) % 4, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    // kDqConvert: the dQ convert of the pairs done (Sm90BwdDqQueue), once the writer has counted this
    // CTA's last tile; each job's index handed over in shared memory (dS's buffer: no GEMM reads it now)
    auto convert_done_pairs = [&]() {
        named_barrier_sync(kConvBar, kConsumerThreads + 32);
        volatile int* pair_word = reinterpret_cast<volatile int*>(ds_smem_ptr);
        const Sm90BwdDqQueue queue(p.tile_counter, p.batch * p.nheads, p.seqlen_q);
        for (;;) {
            if (ctid == 0) *pair_word = queue.pop();
            named_barrier_sync(kConvPairBar, kConsumerThreads);
            const int job = *pair_word;
            named_barrier_sync(kConvPairBar, kConsumerThreads);   // read by all before the next pop
            if (job < 0) break;
            __threadfence();
            sm90_bwd_convert_dq_job<Elem>(p, queue, job, ctid, kConsumerThreads);
        }
    };
    if constexpr (kRoles) {
        // ---- kRoles (head dim 256, the shared-keys tile): the warpgroups split the products by
        // operand instead of by queries. Warpgroup 0 (the Pᵀ side): Sᵀ = K_j Q_iᵀ for all BM queries,
        // Pᵀ, dV_j += Pᵀ dO_i for all 256 columns (RS: Pᵀ from registers). Warpgroup 1 (the dSᵀ side):
        // dPᵀ = V_j dO_iᵀ for all BM queries, dSᵀ = Pᵀ ∘ (dPᵀ - D_i) with Pᵀ handed over in shared
        // memory (16 words per thread, thread c's to thread c: both hold the same elements), dK_j +=
        // dSᵀ Q_i for all 256 columns (RS), dS (transposed) to ds_smem. Both: dQ_i's part for their
        // 128 columns, as the shared-keys path. Sᵀ, dPᵀ are m64n64 (N = BM) instead of m64n32 (half
        // the A-operand reads of K_j, V_j), and dV, dK read Pᵀ, dSᵀ from registers: fewer shared
        // memory bytes per Q block, the resource the shared-keys tile is bound by.
        // Named barriers (256 consumer threads; one side arrives, the other waits): Pᵀ written
        // (kPFullBar) / read (kPFreeBar), warpgroup 0's dQ GEMMs done (kDsFreeBar); dS written
        // (kDsFullBar: the dSᵀ side arrives, the P side waits; the dSᵀ side waits for its own warps'
        // stores on kDsOwnBar, 128 threads: a barrier that both sides bar.sync at different
        // instructions is what compute-sanitizer synccheck calls "divergent thread(s) in block").
        // An arrival is made only where its wait follows (no pending named barrier arrival at the
        // CTA's end).
        constexpr int kPFullBar = 6, kPFreeBar = 7, kDsFullBar = 8, kDsFreeBar = 9, kDsOwnBar = 10;
        constexpr int kNT = kBM / 8;                            // n8 tiles of Sᵀ, dPᵀ (all BM queries)
        const int warp_key = warp * 16;                         // this warp's first key of K_j
        const int seqlen_k = p.seqlen_k;
        auto run = [&](auto side) {
            constexpr bool kPSide = decltype(side)::value;
            float acc[kHeadDim / 2];                            // dV_j (P side) or dK_j: 64 keys x 256
            float sp[1][kNT][4];                                // Sᵀ -> Pᵀ (P side), dPᵀ -> dSᵀ
            float (&sp_flat)[kBM / 2] = reinterpret_cast<float (&)[kBM / 2]>(sp);
            u32 frag[1][kNT / 2][4];                            // Pᵀ or dSᵀ as 16-bit A fragments
            // K_j or V_j (A, K-major), Q_i or dO_i (B of Sᵀ, dPᵀ, K-major), dO_i or Q_i (B of dV, dK,
            // MN-major, all 4 chunks), K_j's columns 128·wg.. (B of dQ, MN-major), dS (A of dQ)
            const DescLo a_desc(kPSide ? k_smem : v_smem, 16);
            const DescLo b_desc(kPSide ? q_smem : do_smem, 16);
            const DescLo bt_desc(kPSide ? do_smem : q_smem, Shape::kQChunkBytes);
            const DescLo kt_desc(k_smem + wg * 2 * Shape::kKVChunkBytes, Shape::kKVChunkBytes);
            const DescLo dsa_desc(ds_smem, 16);
            const auto fresh = [](DescLo d) { d.lo = opaque_u32(d.lo); return d; };
            // this thread's Pᵀ words: word w at (w · 128 + thread) · 4 (a warp's 32 accesses to one
            // word hit 32 banks)
            u32* p_words = reinterpret_cast<u32*>(smem_ptr + Shape::kPOffset) + (ctid % 128);
            // Sᵀ or dPᵀ of the Q block in ring slot `s_slot` (fill parity s_phase), one commit group
            auto issue_sp = [&](int s_slot, u32 s_phase) {
                const u32 s_off = s_slot * Shape::kQBytes;
                mbarrier_wait(q_full(s_slot), s_phase);
                reg_fence(sp_flat);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < kHeadDim / 16; ++kk) {
                    const u32 a_off = (kk / 4) * Shape::kKVChunkBytes + (kk % 4) * 32;
                    const u32 b_off = s_off + (kk / 4) * Shape::kQChunkBytes + (kk % 4) * 32;
                    Wgmma<kBM, Elem>::template ss<0>(sp_flat, fresh(a_desc).at(a_off), fresh(b_desc).at(b_off), kk > 0);
                }
                wgmma_commit();
            };
            // the ring position (slot, fill parity) and kDynamic's counts run on across the CTA's tiles
            int slot = 0;
            u32 phase = 0;
            int q_done = 0, kv_loads = 0;                       // kDynamic: Q blocks, K/V loads of earlier tiles
          for (;;) {                                            // kDynamic: tile after tile; else once
#pragma unroll
            for (int i = 0; i < kHeadDim / 2; ++i) acc[i] = 0.f;
            if (n_iters > 0) mbarrier_wait(kv_full, kDynamic ? u32(kv_loads) & 1 : 0u);
            if constexpr (kSAhead)
                if (n_iters > 0) issue_sp(slot, phase);
            for (int it = 0; it < n_iters; ++it, slot = slot + 1 == kStages ? 0 : slot + 1, phase ^= slot == 0) {
                const int m_block = m_block_at(it), row0 = m_block * kBM;
                const u32 q_off = slot * Shape::kQBytes;
                // ---- Sᵀ = K_j Q_iᵀ or dPᵀ = V_j dO_iᵀ: 64 keys x BM queries (SS; kSAhead: already
                // issued, before the loop or behind the last Q block's dQ GEMMs) ----
                if constexpr (!kSAhead) issue_sp(slot, phase);
                wgmma_wait<0>();
                reg_fence(sp_flat);
                if constexpr (kPSide) {
                    // ---- Pᵀ = exp2(Sᵀ·scale·log2e - LSE_i·log2e), masked as the shared-keys path
                    // (element (nt, e): key warp_key + g + 8·(e / 2), query row0 + 8nt + 2t + e % 2) ----
                    if (mask.template needs_mask<kBN>(row0, n_block)) {
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            const int key = key0 + warp_key + g + 8 * half;
                            const int first = key >= seqlen_k ? kBM + row0 : key - mask.causal_offset;
                            const int first_col = kCausal || key >= seqlen_k ? first - row0 - 2 * t : -1;
#pragma unroll
                            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                                for (int e = 0; e < 2; ++e)
                                    if (nt * 8 + e < first_col) sp[0][nt][2 * half + e] = neg_inf();
                        }
                    }
                    const float* lse_i = lse_smem_f + slot * kBM;
#pragma unroll
                    for (int nt = 0; nt < kNT; ++nt) {
                        const float2 lse = *reinterpret_cast<const float2*>(lse_i + nt * 8 + 2 * t);
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            sp[0][nt][e] = exp2_scaled(sp[0][nt][e], p.scale_log2, e % 2 ? lse.y : lse.x);
                    }
                    pack_a_frags<1, kNT / 2, Elem>(frag, sp);
                    // Pᵀ to the dSᵀ side, once it has read the last Q block's
                    if (it > 0) named_barrier_sync(kPFreeBar, kConsumerThreads);
#pragma unroll
                    for (int w = 0; w < 2 * kNT; ++w) p_words[w * 128] = frag[0][w / 4][w % 4];
                    named_barrier_arrive(kPFullBar, kConsumerThreads);
                    // ---- dV_j += Pᵀ dO_i (RS; dO_i MN-major, queries 16kk..16kk+15 per step) ----
                    reg_fence(acc);
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < kBM / 16; ++kk)
                        Wgmma<kHeadDim, Elem>::template rs<1>(acc, frag[0][kk], fresh(bt_desc).at(q_off + kk * 16 * 128), 1);
                    wgmma_commit();
                    named_barrier_sync(kDsFullBar, kConsumerThreads);   // dS is in ds_smem
                } else {
                    // ---- dSᵀ = Pᵀ ∘ (dPᵀ - D_i), Pᵀ (16 bits) from the P side's words ----
                    named_barrier_sync(kPFullBar, kConsumerThreads);
                    const float* D_i = D_smem_f + slot * kBM;
#pragma unroll
                    for (int nt = 0; nt < kNT; ++nt) {
                        const float2 D = *reinterpret_cast<const float2*>(D_i + nt * 8 + 2 * t);
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const u32 pair = p_words[(2 * nt + e / 2) * 128];
                            const float P = to_float<Elem>(u16(e % 2 ? pair >> 16 : pair & 0xFFFFu));
                            sp[0][nt][e] = P * (sp[0][nt][e] - (e % 2 ? D.y : D.x));
                        }
                    }
                    if (it + 1 < n_iters) named_barrier_arrive(kPFreeBar, kConsumerThreads);
                    pack_a_frags<1, kNT / 2, Elem>(frag, sp);
                    // ---- dS to ds_smem (queries x keys, stmatrix.trans as the shared-keys path), once
                    // the P side's dQ GEMMs of the last Q block are done ----
                    if (it > 0) named_barrier_sync(kDsFreeBar, kConsumerThreads);
                    {
                        const int r = lane / 8;
                        const u32 addr = ds_smem + swizzled_offset(8 * (r / 2) + lane % 8, warp_key + 8 * (r % 2), kBM);
#pragma unroll
                        for (int kk = 0; kk < kBM / 16; ++kk) stmatrix_x4_trans(addr + kk * 16 * 128, frag[0][kk]);
                    }
                    // ---- dK_j += dSᵀ Q_i (RS; Q_i MN-major; scaled in the epilogue) ----
                    reg_fence(acc);
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < kBM / 16; ++kk)
                        Wgmma<kHeadDim, Elem>::template rs<1>(acc, frag[0][kk], fresh(bt_desc).at(q_off + kk * 16 * 128), 1);
                    wgmma_commit();
                    fence_proxy_async_smem();                       // generic stores -> wgmma's reads
                    named_barrier_arrive(kDsFullBar, kConsumerThreads);
                    // (a wait here too: this warpgroup's dQ GEMM reads all four warps' stores)
                    named_barrier_sync(kDsOwnBar, 128);
                }
                // ---- dQ_i part = dS K_j, this warpgroup's 128 columns in two 64-column pieces (as the
                // shared-keys path: red.add, or staged in the slot for the writer warp) ----
#pragma unroll
                for (int piece = 0; piece < 2; ++piece) {
                    float dq_part[32];
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < kBN / 16; ++kk)
                        Wgmma<64, Elem>::template ss<1>(dq_part, fresh(dsa_desc).at(kk * 32),
                                                        fresh(kt_desc).at(piece * Shape::kKVChunkBytes + kk * 16 * 128), kk > 0);
                    wgmma_commit();
                    if (kSAhead && piece == 1 && it + 1 < n_iters) {
                        // kSAhead: the next Q block's Sᵀ or dPᵀ behind this last dQ GEMM (the tensor
                        // cores run it while this thread stores the dQ part); wait for the dQ part only
                        const int next = slot + 1 == kStages ? 0 : slot + 1;
                        issue_sp(next, next == 0 ? phase ^ 1u : phase);
                        wgmma_wait<1>();
                    } else {
                        wgmma_wait<0>();                            // (piece 0: dV or dK too: the slot is read)
                    }
                    reg_fence(dq_part);
                    if (piece == 0) {
                        reg_fence(acc);
                        mbarrier_arrive(q_empty(slot));             // this thread is done with the slot
                        if constexpr (kCluster)                     // (the partner's producer too)
                            if (it + kStages < n_iters)
                                mbarrier_arrive_remote(mapa_shared(q_empty(slot), cluster_ctarank() ^ 1u));
                    }
                    if constexpr (kSlotDq) {
                        // into boxes 4wg + 2·piece, + 1 (Sm90BwdSlotDqStage<.., true>: the P side's in
                        // dO_i's chunks, its dV was their last reader and the dSᵀ side's dPᵀ finished
                        // before dS was handed over; the dSᵀ side's in Q_i's, likewise), stored as the
                        // shared-keys path stores them
                        store_slot_dq_r2s<Sm90BwdSlotDqStage<Shape, true>>(smem_ptr, smem, q_off, 4 * wg + 2 * piece,
                                                                           dq_part, warp, g, t);
                    } else {
                        float* dq_rows = p.dq_accum + (bh * p.seqlen_q_rounded + row0 + warp * 16) * p.head_dim_rounded
                                         + wg * 128 + piece * 64;
#pragma unroll
                        for (int j = 0; j < 4; ++j)
                            red_add_tile_16x16(dq_rows + j * 16, p.head_dim_rounded,
                                               reinterpret_cast<const float (&)[2][4]>(dq_part[8 * j]), g, t);
                    }
                }
                // ds_smem may be rewritten (the P side's dQ GEMMs are done; the dSᵀ side waited for its own)
                if (kPSide && it + 1 < n_iters) named_barrier_arrive(kDsFreeBar, kConsumerThreads);
                if constexpr (kSlotDq) {
                    fence_proxy_async_smem();                       // generic stores -> the bulk op's reads
                    named_barrier_arrive(kDqFullBar + ((q_done + it) & 1), kDqBarThreads);   // (the writer's q & 1)
                }
            }
            if constexpr (kDynamic) {
                if (n_iters > 0) {                                  // K_j, V_j read for the last time
                    mbarrier_arrive(kv_empty);
                    ++kv_loads;
                }
            }
            // ---- epilogue: dV_j (P side) or dK_j = scale · Σ dSᵀ Q, all 256 columns (MHA straight
            // into dv / dk; GQA / MQA fp32 per query head, summed by fa2_bwd_reduce_dkv) ----
            const bool grouped = p.nheads != p.nheads_kv;
            const float scale = kPSide ? 1.f : p.softmax_scale;
            float* accum = kPSide ? p.dv_accum : p.dk_accum;
            // kWideEpi (where wide_epi_fits): 16 bytes a lane (store_row_wide); otherwise 4 bytes a lane, below
            bool wide = false;
            if constexpr (kWideEpi) {
                wide = wide_epi_fits(p);
                if (wide) {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int key = key0 + warp_key + g + 8 * half;
                        u16* out = kPSide ? static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + key * p.dv_row_stride
                                                + head * p.dv_head_stride
                                          : static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + key * p.dk_row_stride
                                                + head * p.dk_head_stride;
                        store_row_wide<kHeadDim, Elem>(out, acc, half, scale, 0, p.head_dim, key < seqlen_k, t);
                    }
                }
            }
#pragma unroll
            for (int half = 0; half < 2 && !wide; ++half) {
                const int key = key0 + warp_key + g + 8 * half;
                if (key >= seqlen_k) continue;
#pragma unroll
                for (int nt = 0; nt < kHeadDim / 8; ++nt) {
                    const int col = nt * 8 + 2 * t;
                    const float v0 = acc[4 * nt + 2 * half] * scale, v1 = acc[4 * nt + 2 * half + 1] * scale;
                    if (grouped) {
                        *reinterpret_cast<float2*>(accum + (bh * p.seqlen_k + key) * p.head_dim_rounded + col)
                            = make_float2(v0, v1);
                    } else if (col < p.head_dim) {
                        u16* out = kPSide ? static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + key * p.dv_row_stride
                                                + head * p.dv_head_stride + col
                                          : static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + key * p.dk_row_stride
                                                + head * p.dk_head_stride + col;
                        *reinterpret_cast<u32*>(out) = pack2<Elem>(v0, v1);
                    }
                }
            }
            if constexpr (!kDynamic) break;
            if (!take_next_tile(q_done)) break;
          }   // the tile loop
        };
        if (wg == 0) run(Sm90BwdSide<true>{});
        else run(Sm90BwdSide<false>{});
        if constexpr (kDqConvert) convert_done_pairs();
        return;
    }

    // this warp's first key in K_j (kSharedKeys: both warpgroups see the same 64 keys), the first
    // of this warpgroup's kSN queries of Sᵀ in Q_i, its first column of dK_j, dV_j
    const int wg_key0 = kSharedKeys ? 0 : wg * 64;
    const int warp_key = wg_key0 + warp * 16;
    const int q_col0 = kSharedKeys ? wg * kSN : 0;
    const int dkv_col0 = kSharedKeys ? wg * kDkvN : 0;
    // kSoftcap, kDropout: this thread's 1 - tanh² and signed Pᵀ (BM / 2 elements each, 16 bits,
    // packed as Pᵀ's A fragments) live from Sᵀ to dSᵀ in shared memory (Sm90BwdThreadWords; no
    // other thread reads them, so no barrier): in registers they would spill the d128 kernel
    // (dK, dV, Pᵀ, dPᵀ are all live then). Word w of Pᵀ's element (nt, e) is 2nt + e / 2.
    // (kSharedKeys: kSN / 4 words per flag, in registers: the keys' split leaves room there)
    unsigned char* words_smem_ptr = smem_ptr + Words::kOffset + (tid - 128) * 4;
    u32 words_rmem[kSharedKeys && kWordCount > 0 ? kWordCount : 1];
    auto thread_word = [&](int w) -> u32& {
        if constexpr (kSharedKeys) return words_rmem[w];
        else return *reinterpret_cast<u32*>(words_smem_ptr + w * kConsumerThreads * 4);
    };
    // kCapFold: the softcap words of k16 step kk (words 4kk .. 4kk + 3, its A fragment's registers) as one
    // 16-byte vector, the thread's 16 bytes of vector row kk (a row: kConsumerThreads · 16 bytes), in the
    // same bytes as thread_word's words 0 .. BM/4 - 1: one STS.128 / LDS.128 for four 32-bit ones (a warp's
    // 512 contiguous bytes: no bank conflict beyond the four wavefronts)
    auto cap_words = [&](int kk) -> uint4& {
        return *reinterpret_cast<uint4*>(smem_ptr + Words::kOffset + (tid - 128) * 16 + kk * kConsumerThreads * 16);
    };
    auto store_cap_words = [&](int kk, const u32 (&w)[4]) {
        if constexpr (kSharedKeys) {
#pragma unroll
            for (int r = 0; r < 4; ++r) thread_word(kCapWord0 + 4 * kk + r) = w[r];
        } else {
            cap_words(kk) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    };
    auto load_cap_words = [&](int kk, u32 (&w)[4]) {
        if constexpr (kSharedKeys) {
#pragma unroll
            for (int r = 0; r < 4; ++r) w[r] = thread_word(kCapWord0 + 4 * kk + r);
        } else {
            const uint4 v = cap_words(kk);
            w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
        }
    };

    // Descriptors: this warpgroup's 64 rows of K_j, V_j (A, K-major); Q_i, dO_i as B of Sᵀ, dPᵀ
    // (K-major: the head dim is the reduction) and of dK, dV (MN-major: the head dim is wgmma's
    // N, contiguous); K_j as B of dQ (MN-major); dS as A of dQ (K-major, this warpgroup's rows).
    // (kSharedKeys: Q_i, dO_i as B of Sᵀ, dPᵀ from this warpgroup's first query, whole swizzle
    // periods in; as B of dK, dV from its first column chunk)
    const DescLo k_rows_desc(k_smem + wg_key0 * 128, 16);
    const DescLo v_rows_desc(v_smem + wg_key0 * 128, 16);
    const DescLo q_desc(q_smem + q_col0 * 128, 16);
    const DescLo do_desc(do_smem + q_col0 * 128, 16);
    const DescLo q_t_desc(q_smem + (dkv_col0 / 64) * Shape::kQChunkBytes, Shape::kQChunkBytes);
    const DescLo do_t_desc(do_smem + (dkv_col0 / 64) * Shape::kQChunkBytes, Shape::kQChunkBytes);
    // kSharedKeys: Pᵀ and dSᵀ of all BM queries (keys x queries, K-major) as A of dV, dK
    const DescLo p_desc(smem + Shape::kPOffset, 16);
    const DescLo dst_desc(smem + Shape::kDstOffset, 16);
    // kSharedKeys: a descriptor re-derived at its use in the loop (opaque_u32), not hoisted
    const auto fresh = [](DescLo d) {
        if constexpr (kSharedKeys || kSAhead) d.lo = opaque_u32(d.lo);
        return d;
    };
    const int dq_row_group = wg % Shape::kDqRowGroups, dq_col_group = wg / Shape::kDqRowGroups;
    const int dq_col0 = dq_col_group * Shape::kDqN;
    // (kDqN = 32, head dim 64 split over 2 warpgroups: the second one's columns 32..63 start 64
    // bytes into each 128-byte row of K_j's chunk. The swizzle is a function of the address bits
    // (the chunk is 1024-byte aligned), so a start inside the atom addresses the same bytes TMA
    // wrote, as the K-major k-steps' 32-byte advances do; bits 7..9 are unchanged: base offset 0.)
    const DescLo k_t_desc(k_smem + (dq_col0 / 64) * Shape::kKVChunkBytes + (Shape::kDqN % 64 ? (dq_col0 % 64) * 2 : 0),
                          Shape::kKVChunkBytes);
    const DescLo ds_desc(ds_smem + dq_row_group * 64 * 128, 16);

    // Shared-window address of this lane's row of its dS stores (stmatrix_x4_trans: lane l gives
    // stored row l % 8, query 8·(r / 2) + l % 8 of 16, of matrix r = l / 8, keys warp_key + 8·(r % 2)
    // .. + 7, one 16-byte unit); step kk adds 16 rows, a whole number of swizzle periods.
    const auto ds_store_lane = [&]() {
        const int r = lane / 8;
        return ds_smem + swizzled_offset(q_col0 + 8 * (r / 2) + lane % 8, warp_key + 8 * (r % 2), kBM);
    };
    const u32 ds_store_addr = ds_store_lane();
    // kSharedKeys: the lane's row of its Pᵀ / dSᵀ stores at k16 step kk (stmatrix_x4, not
    // transposed: stored row l % 8 of matrix r = l / 8 is key warp_key + 8·(r % 2) + l % 8, its
    // 16 bytes queries q_col0 + 16kk + 8·(r / 2) ..+ 7), as a byte offset into p_smem / dst_smem
    const auto pt_store_offset = [&](int kk) {
        const int r = lane / 8;
        return swizzled_offset(warp_key + 8 * (r % 2) + lane % 8, q_col0 + 16 * kk + 8 * (r / 2), kBN);
    };

    // Accumulators (per warpgroup, 64 rows; wgmma layout above):
    // (kSharedKeys: dK_j, dV_j of kDkvN columns; Sᵀ, dPᵀ of kSN queries)
    float dk_acc[kDkvN / 2], dv_acc[kDkvN / 2];                // 64 keys x head_dim
    float s_acc[1][kSN / 8][4], dp_acc[1][kSN / 8][4];         // Sᵀ / Pᵀ, dPᵀ / dSᵀ: 64 keys x BM
    float dq_acc[kDqSwap ? Shape::kDqN * kBM / 128 : Shape::kDqN / 2];  // 64 queries x kDqN (kDqSwap: kDqN x BM)
    float (&s_flat)[kSN / 2] = reinterpret_cast<float (&)[kSN / 2]>(s_acc);
    float (&dp_flat)[kSN / 2] = reinterpret_cast<float (&)[kSN / 2]>(dp_acc);
    u32 p_frag[1][kSN / 16][4], ds_frag[1][kSN / 16][4];
    // the ring position, counted along (q % kStages and the fill's parity (q / kStages) & 1 of
    // the CTA's q-th Q block, without a division per iteration), across tiles with kDynamic
    int slot = 0;
    u32 phase = 0;
    int q_done = 0, kv_loads = 0;                               // kDynamic: Q blocks, K/V loads of earlier tiles
    for (;;) {                                                  // kDynamic: tile after tile; else once
#pragma unroll
        for (int i = 0; i < kDkvN / 2; ++i) dk_acc[i] = dv_acc[i] = 0.f;
        // softcap and ALiBi (score.cuh; inert without them): the ALiBi slope of this (batch, head)
        const ScoreMod<kSoftcap, kAlibi> score(p.softcap_in, p.softcap_out, p.alibi_slopes, p.alibi_batch_stride,
                                               batch, head, p.softmax_scale, kVarlen ? seq.seqlen_q : p.seqlen_q,
                                               kVarlen ? seq.seqlen_k : p.seqlen_k);
        // kDropout: the generator's state (the drop threshold and the keep scale 1 / (1 - p) are
        // read from the params where they are used: fewer registers across the loop)
        Dropout dropout{};
        if constexpr (kDropout) dropout = Dropout::load(p.rng_state, p.dropout_threshold, p.dropout_scale);

        if (n_iters > 0) mbarrier_wait(kv_full, kDynamic ? u32(kv_loads) & 1 : 0u);
        // ---- Sᵀ = K_j Q_iᵀ of Q block (slot) on the tensor cores: at the top of each Q block, or
        // with kSAhead the next block's behind this one's dQ GEMM (the tile's first one here) ----
        auto issue_s = [&](int s_slot) {
            const u32 s_off = s_slot * Shape::kQBytes;
            reg_fence(s_flat);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kHeadDim / 16; ++kk) {
                // k16 step kk: column chunk kk / 4, 32 bytes per step inside the chunk
                const u32 a_off = (kk / 4) * Shape::kKVChunkBytes + (kk % 4) * 32;
                const u32 b_off = s_off + (kk / 4) * Shape::kQChunkBytes + (kk % 4) * 32;
                Wgmma<kSN, Elem>::template ss<0>(s_flat, fresh(k_rows_desc).at(a_off),
                                                 (kSAhead ? fresh(q_desc) : q_desc).at(b_off), kk > 0);
            }
            wgmma_commit();
        };
        if constexpr (kSAhead) {
            if (n_iters > 0) {
                mbarrier_wait(q_full(slot), phase);
                issue_s(slot);
            }
        }
        for (int it = 0; it < n_iters; ++it, slot = slot + 1 == kStages ? 0 : slot + 1, phase ^= slot == 0) {
            const int m_block = m_block_at(it), row0 = m_block * kBM;
            const int q0 = row0 + q_col0;                           // this warpgroup's first query of Sᵀ
            const u32 q_off = slot * Shape::kQBytes;               // this slot's Q_i, dO_i (bytes)
            // kDropout: the keep mask Z of this thread's Pᵀ elements, one bit each (bit 4nt + e of
            // element (nt, e)). Dropout alone: drawn while Sᵀ's GEMM runs (the rounds take a call's few
            // registers at a time: keep_bits_transposed), off the path from Sᵀ to dK, dV. With softcap
            // or ALiBi: before Sᵀ's accumulators are live (and while Q_i may still be landing): there
            // the Philox rounds next to dK, dV and Sᵀ spill the d128 kernel (nvcc 13.0)
            constexpr bool kDrawUnderS = kDropout && !kSoftcap && !kAlibi && !kWindow && !kDqEarly;
            // (kDropPacked: the keep flags as byte signs instead, dropout_transposed.cuh)
            u32 keep_bits = 0;
            static_assert(!kDropout || kSN / 2 <= 32, "dropout: one keep bit per Pᵀ element of a thread, 32 at most");
            auto draw_keep = [&]() -> u32 {
                if constexpr (!kDropout)   // (discarded: the plain kernels instantiate no keep test)
                    return 0u;
                else if constexpr (kDropPacked)
                    return keep_flags_transposed<kSN / 8, kDropPacked >= 2, kDropPacked == 3 ? 0 : kPhiloxRounds>(
                        dropout, KeepSwar::make(dropout.threshold), static_cast<int>(bh), key0 + warp_key, q0, g, t);
                else
                    return dropout.keep_bits_transposed<kSN / 8>(static_cast<int>(bh), key0 + warp_key, q0, g, t);
            };
            if constexpr (kDropout && !kDrawUnderS) keep_bits = draw_keep();
            // ---- Sᵀ = K_j Q_iᵀ (kSAhead: already issued, behind the last Q block's dQ GEMM or
            // before the loop) ----
            if constexpr (!kSAhead) {
                mbarrier_wait(q_full(slot), phase);
                issue_s(slot);
            }
            if constexpr (kDrawUnderS) keep_bits = draw_keep();
            if constexpr (kOverlapSdp) {
                // dPᵀ = V_j dO_iᵀ right behind Sᵀ (its own group): the tensor cores run it while this
                // thread turns Sᵀ into Pᵀ below; only Sᵀ is waited for here
                reg_fence(dp_flat);
#pragma unroll
                for (int kk = 0; kk < kHeadDim / 16; ++kk) {
                    const u32 a_off = (kk / 4) * Shape::kKVChunkBytes + (kk % 4) * 32;
                    const u32 b_off = q_off + (kk / 4) * Shape::kQChunkBytes + (kk % 4) * 32;
                    Wgmma<kSN, Elem>::template ss<0>(dp_flat, fresh(v_rows_desc).at(a_off), do_desc.at(b_off), kk > 0);
                }
                wgmma_commit();
                wgmma_wait<1>();                                    // Sᵀ is ready (dPᵀ may still run)
            } else {
                wgmma_wait<0>();
            }
            reg_fence(s_flat);

            // ---- Pᵀ = exp2(Sᵀ·scale·log2e - LSE·log2e); padded queries have LSE = +inf -> 0 ----
            const float* lse_i = lse_smem_f + slot * kBM + q_col0;
            const float* D_i = D_smem_f + slot * kBM + q_col0;
            // Masked elements (only in the ragged and the causal diagonal blocks): mask.cuh's rule per
            // row of Sᵀ, i.e. per key: key k is seen by the queries from first_query(k) on, none past
            // seqlen_k. The column offset of this thread's queries is 2t (+ 8nt + e % 2). `fill`:
            // -inf before the exp2, 0 after it.
            auto hide = [&](float fill) {
                if constexpr (kWindow) {
                    // the band's rule per key: key k is seen by the queries k - offset - right ..
                    // k - offset + left (a bound of -1: none), none past seqlen_k; as column offsets
                    // from this thread's 2t: [lo, hi]
                    if (band.template needs_mask<kBN, kBM>(row0, n_block)) {
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            const int key = key0 + warp_key + g + 8 * half;
                            const int diag = key - band.causal_offset - q0 - 2 * t;  // the query on k's diagonal
                            const int lo = key >= (kVarlen ? seq.seqlen_k : p.seqlen_k) ? kSN
                                           : band.has_right() ? diag - band.right : 0;
                            const int hi = band.has_left() ? diag + band.left : kSN;
#pragma unroll
                            for (int nt = 0; nt < kSN / 8; ++nt)
#pragma unroll
                                for (int e = 0; e < 2; ++e)
                                    if (nt * 8 + e < lo || nt * 8 + e > hi) s_acc[0][nt][2 * half + e] = fill;
                        }
                    }
                } else if (mask.template needs_mask<kBN>(row0, n_block)) {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int key = key0 + warp_key + g + 8 * half;
                        const int seqlen_k = kVarlen ? seq.seqlen_k : p.seqlen_k;
                        const int first = key >= seqlen_k ? kSN + q0 : key - mask.causal_offset;
                        const int first_col = kCausal || key >= seqlen_k ? first - q0 - 2 * t : -1;
#pragma unroll
                        for (int nt = 0; nt < kSN / 8; ++nt)
#pragma unroll
                            for (int e = 0; e < 2; ++e)
                                if (nt * 8 + e < first_col) s_acc[0][nt][2 * half + e] = fill;
                    }
                }
            };
            if constexpr (!ScoreMod<kSoftcap, kAlibi>::kOn) {
                // (kOverlapSdp: the mask after the exp2, hidden elements -> 0, as with the score
                // modifiers below: with dPᵀ's accumulators live the mask's values must not outlive
                // the exp2s; the d128 causal kernel spills otherwise)
                if constexpr (!kOverlapSdp) hide(neg_inf());
#pragma unroll
                for (int nt = 0; nt < kSN / 8; ++nt) {
                    const float2 lse = *reinterpret_cast<const float2*>(lse_i + nt * 8 + 2 * t);
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        s_acc[0][nt][e] = exp2_scaled(s_acc[0][nt][e], p.scale_log2, e % 2 ? lse.y : lse.x);
                }
                if constexpr (kOverlapSdp) hide(0.f);
            } else if constexpr (kCapFold) {
                // kCapFold: t = tanh(Sᵀ·softcap_in) in place, then Pᵀ = exp2(t·softcap·log2e - LSE·log2e),
                // softcap_out folded into the exponent's FFMA; the word keeps Pᵀ ∘ (1 - t²), rounded to 16
                // bits once, for dSᵀ (the one factor dSᵀ needs besides dPᵀ - D_i: no Pᵀ unpacked there).
                // A masked block (the causal diagonal, a ragged end) runs a copy of its own with the mask on
                // t (kCapHiddenT: P = 0 below, and so its word) between the tanhs and the exp2s, so that the
                // other blocks' tanhs and exp2s stay one basic block (sm90_fwd's kMaskedCopy, session 21:
                // the branch between them serializes the two MUFU bursts); the copy also masks Sᵀ before
                // its tanhs (-inf: t = -1, masked again after), which keeps the compiler from hoisting the
                // two copies' identical tanhs above the branch
                const float cap_log2 = score.softcap_out * p.scale_log2;   // softcap·log2(e)
                auto fold_step = [&](bool masked) {   // (masked: a constant at each call)
                    if (masked) hide(neg_inf());
#pragma unroll
                    for (int i = 0; i < kSN / 2; ++i) s_flat[i] = tanh_approx(s_flat[i] * score.softcap_in);
                    if (masked) hide(kCapHiddenT);
#pragma unroll
                    for (int kk = 0; kk < kSN / 16; ++kk) {
                        u32 words[4];                   // word r: elements (2kk + r / 2, 2·(r % 2) + lo/hi)
#pragma unroll
                        for (int r = 0; r < 4; ++r) {
                            const int nt = 2 * kk + r / 2, half = r % 2;
                            const float2 lse = *reinterpret_cast<const float2*>(lse_i + nt * 8 + 2 * t);
                            float pc[2];
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                float& s = s_acc[0][nt][2 * half + e];
                                const float th = s;
                                // (kCapFold 3: word 3 of each k16 step, a quarter of the exp2s, on the
                                // FMA pipes: exp2_emu.cuh)
                                s = kCapFold == 3 && r == 3 ? exp2_poly<3>(fmaf(th, cap_log2, -(e ? lse.y : lse.x)))
                                                            : exp2_scaled(th, cap_log2, e ? lse.y : lse.x);
                                pc[e] = s * fmaf(-th, th, 1.f);
                            }
                            words[r] = pack2<Elem>(pc[0], pc[1]);
                        }
                        store_cap_words(kk, words);
                    }
                };
                bool masked_block;                      // (hide's test)
                if constexpr (kWindow) masked_block = band.template needs_mask<kBN, kBM>(row0, n_block);
                else masked_block = mask.template needs_mask<kBN>(row0, n_block);
                if (masked_block)
                    fold_step(true);
                else
                    fold_step(false);
            } else {
                // Sᵀ through the score modifiers (score.cuh, raw units) on the way to the exp2, the
                // mask after it (hidden elements -> 0, whatever their modified score). Element
                // (nt, e): key warp_key + g + 8·(e / 2), query 8nt + 2t + e % 2. Softcap keeps
                // 1 - tanh² for dSᵀ, rounded to 16 bits like dSᵀ itself, packed as pack_a_frags
                // packs Pᵀ (word 2·(nt % 2) + e / 2 of k16 step nt / 2), in shared memory (above).
#pragma unroll
                for (int nt = 0; nt < kSN / 8; ++nt) {
                    const float2 lse = *reinterpret_cast<const float2*>(lse_i + nt * 8 + 2 * t);
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int key = key0 + warp_key + g + 8 * half;
                        float dtanh[2];
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float th = 0.f;
                            float& s = s_acc[0][nt][2 * half + e];
                            s = exp2_scaled(score.apply(s, q0 + nt * 8 + 2 * t + e, key, th), p.scale_log2,
                                            e ? lse.y : lse.x);
                            dtanh[e] = 1.f - th * th;
                        }
                        if constexpr (kSoftcap) thread_word(kCapWord0 + 2 * nt + half) = pack2<Elem>(dtanh[0], dtanh[1]);
                    }
                }
                hide(0.f);
            }
            if constexpr (kDropPacked) {
                // ---- dropout on the packed words (dropout_transposed.cuh): Pᵀ packed as it is, then per
                // word the signed Pᵀ to this thread's words for dSᵀ and Pᵀ ∘ Z for dV (its 1 / (1 - p)
                // in the epilogue) ----
                pack_a_frags<1, kSN / 16, Elem>(p_frag, s_acc);
#pragma unroll
                for (int nt = 0; nt < kSN / 8; ++nt)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        u32& word = p_frag[0][nt / 2][2 * (nt % 2) + half];
                        u32 signed_p;
                        word = drop_packed_word(word, keep_bits, nt / 2, 2 * half + nt % 2, signed_p);
                        thread_word(kPWord0 + 2 * nt + half) = signed_p;
                    }
            } else if constexpr (kDropout) {
                // ---- dropout: the dropped elements of Pᵀ negated (Pᵀ >= 0, so the sign is ¬Z, as
                // Dropout::negate_dropped_transposed; a hidden element, 0, stays a zero), the signed
                // Pᵀ to this thread's words for dSᵀ, and Pᵀ ∘ Z / (1 - p), its positive part
                // scaled, for dV ----
#pragma unroll
                for (int nt = 0; nt < kSN / 8; ++nt)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        float& p0 = s_acc[0][nt][2 * half];
                        float& p1 = s_acc[0][nt][2 * half + 1];
                        if (!((keep_bits >> (4 * nt + 2 * half)) & 1u)) p0 = -p0;
                        if (!((keep_bits >> (4 * nt + 2 * half + 1)) & 1u)) p1 = -p1;
                        thread_word(kPWord0 + 2 * nt + half) = pack2<Elem>(p0, p1);
                        p0 = fmaxf(p0, 0.f) * p.dropout_scale;
                        p1 = fmaxf(p1, 0.f) * p.dropout_scale;
                    }
            }
            // Pᵀ as 16-bit A fragments: the fp32 Pᵀ dies here, before dPᵀ's accumulators are born
            // (with dK, dV in registers the d128 kernel has no room for both), so dS below uses
            // Pᵀ rounded to 16 bits, as the dV product does (and as attention in 16 bits would).
            // (kDropPacked: packed above)
            if constexpr (!kDropPacked) pack_a_frags<1, kSN / 16, Elem>(p_frag, s_acc);

            // ---- dPᵀ = V_j dO_iᵀ (SS; kOverlapSdp: already issued behind Sᵀ), then dV_j += Pᵀ dO_i
            // (RS; dO_i MN-major, queries 16kk..16kk+15 per step) ----
            if constexpr (!kOverlapSdp) reg_fence(dp_flat);
            reg_fence(dv_acc);
            // kFragPin: Pᵀ's fragments pinned at the fence, so that ptxas does not copy one between
            // it and dV's wgmma (it injects a warpgroup.arrive per k16 step then, each step its own
            // group: wgmma_wait<1> below would wait for 3 of dV's 4 steps, not for dPᵀ alone)
            if constexpr (kFragPin)
#pragma unroll
                for (int kk = 0; kk < kSN / 16; ++kk) reg_fence_frag(p_frag[0][kk]);
            wgmma_fence();
            if constexpr (!kOverlapSdp) {
#pragma unroll
                for (int kk = 0; kk < kHeadDim / 16; ++kk) {
                    const u32 a_off = (kk / 4) * Shape::kKVChunkBytes + (kk % 4) * 32;
                    const u32 b_off = q_off + (kk / 4) * Shape::kQChunkBytes + (kk % 4) * 32;
                    Wgmma<kSN, Elem>::template ss<0>(dp_flat, fresh(v_rows_desc).at(a_off), do_desc.at(b_off), kk > 0);
                }
                wgmma_commit();
            }
            if constexpr (kSharedKeys) {
                wgmma_wait<0>();                                    // dPᵀ is ready (dV waits for all of Pᵀ)
            } else {
#pragma unroll
                for (int kk = 0; kk < kBM / 16; ++kk)
                    Wgmma<kHeadDim, Elem>::template rs<1>(dv_acc, p_frag[0][kk], do_t_desc.at(q_off + kk * 16 * 128), 1);
                wgmma_commit();
                wgmma_wait<1>();                                    // dPᵀ is ready (dV may still run)
            }
            reg_fence(dp_flat);

            // ---- dSᵀ = Pᵀ ∘ (dPᵀ - D_i), to 16-bit A fragments ----
            // p_frag[kk][r] holds Pᵀ elements (nt, e) = (2kk + r / 2, 2·(r % 2) + lo/hi) (gemm.cuh)
            // (kCapFold 2: dPᵀ - D_i rounded to 16 bits and multiplied by the word Pᵀ ∘ (1 - t²) two
            // elements an instruction (mul2), word 2nt + half being A fragment register 2·(nt % 2) + half
            // of k16 step nt / 2: dSᵀ rounded twice)
            if constexpr (kCapFold >= 2) {
#pragma unroll
                for (int kk = 0; kk < kSN / 16; ++kk) {
                    u32 words[4];
                    load_cap_words(kk, words);
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int nt = 2 * kk + r / 2, half = r % 2;
                        const float2 D = *reinterpret_cast<const float2*>(D_i + nt * 8 + 2 * t);
                        ds_frag[0][kk][r] = mul2<Elem>(pack2<Elem>(dp_acc[0][nt][2 * half] - D.x,
                                                                   dp_acc[0][nt][2 * half + 1] - D.y), words[r]);
                    }
                }
            }
#pragma unroll
            for (int nt = 0; nt < (kCapFold >= 2 ? 0 : kSN / 8); ++nt) {
                const float2 D = *reinterpret_cast<const float2*>(D_i + nt * 8 + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if constexpr (kDropout) {  // dS = |P| ∘ (Z ∘ dP / (1 - p) - D), P from the signed words
                        const u32 pair = thread_word(kPWord0 + 2 * nt + e / 2);
                        const float P = to_float<Elem>(u16(e % 2 ? pair >> 16 : pair & 0xFFFFu));
                        const float z = P > 0.f ? p.dropout_scale : 0.f;
                        dp_acc[0][nt][e] = fabsf(P) * (dp_acc[0][nt][e] * z - (e % 2 ? D.y : D.x));
                    } else if constexpr (kCapFold) {  // dS = (P ∘ (1 - tanh²)) ∘ (dP - D), the first from the word
                        u32 words[4];                   // (k16 step nt / 2's vector: one load for its 16 elements)
                        load_cap_words(nt / 2, words);
                        const u32 pair = words[2 * (nt % 2) + e / 2];
                        const float Pc = to_float<Elem>(u16(e % 2 ? pair >> 16 : pair & 0xFFFFu));
                        dp_acc[0][nt][e] = Pc * (dp_acc[0][nt][e] - (e % 2 ? D.y : D.x));
                    } else {
                        const u32 pair = p_frag[0][nt / 2][2 * (nt % 2) + e / 2];
                        const float P = to_float<Elem>(u16(e % 2 ? pair >> 16 : pair & 0xFFFFu));
                        dp_acc[0][nt][e] = P * (dp_acc[0][nt][e] - (e % 2 ? D.y : D.x));
                    }
                    if constexpr (kSoftcap && !kCapFold) {  // d(softcap·tanh(x / softcap))/dx = 1 - tanh²
                        const u32 dtanh = thread_word(kCapWord0 + 2 * nt + e / 2);
                        dp_acc[0][nt][e] *= to_float<Elem>(u16(e % 2 ? dtanh >> 16 : dtanh & 0xFFFFu));
                    }
                }
            }
            if constexpr (kCapFold < 2) pack_a_frags<1, kSN / 16, Elem>(ds_frag, dp_acc);

            // ---- dK_j += dSᵀ Q_i (RS; Q_i MN-major; scaled once, in the epilogue) ----
            // (kSharedKeys: both by SS once every warpgroup's Pᵀ, dSᵀ are in shared memory, below)
            // (kDkLate: issued after the dQ GEMM instead, FlashAttention-3's order, so that it runs
            // while the dQ part is staged)
            auto issue_dk = [&]() {
                if constexpr (!kSharedKeys) {
                    reg_fence(dk_acc);
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < kBM / 16; ++kk)
                        Wgmma<kHeadDim, Elem>::template rs<1>(dk_acc, ds_frag[0][kk], q_t_desc.at(q_off + kk * 16 * 128), 1);
                    wgmma_commit();
                }
            };
            if constexpr (!kSharedKeys && !kDkLate) issue_dk();

            // ---- dS to shared memory: every warpgroup's previous dQ GEMM is done (it waited for it
            // before the barrier), so ds_smem is free. ds_frag register r of step kk holds keys
            // g + 8·(r % 2), queries 16kk + 2t + 8·(r / 2) (two adjacent queries per register): four
            // 8x8 matrices, stored transposed (dS[query][key], 16 bits each) by one stmatrix per step,
            // 16 bytes (8 keys) a row. The 8 rows of a matrix are 8 consecutive queries, whose
            // 128-byte swizzle puts their units on 8 distinct bank groups: no bank conflicts (2-byte
            // stores took 8 instructions per step, each 64 bytes).
            // kDsDouble: Q block q's dS goes to buffer q % 2, which the dQ GEMMs of Q block q - 2 read:
            // both warpgroups waited for theirs before the barrier after Q block q - 1's stores,
            // which this thread has passed, so no barrier is needed here
            // (q % 2 is slot % 2 for an even ring: no register of its own)
            const int q_parity = kStages % 2 == 0 ? slot & 1 : (kDynamic ? q_done + it : it) & 1;
            const u32 ds_buf = kDsDouble ? u32(q_parity) * Shape::kDsBytes : 0u;
            if constexpr (!kDsDouble) named_barrier_sync(1, kConsumerThreads);
            if constexpr (kSharedKeys) {
                // kSharedKeys: this warpgroup's Pᵀ and dSᵀ (64 keys x its kSN queries) as they are,
                // keys x queries (K-major A operands of dV, dK: stmatrix without .trans); the barrier
                // above also freed them (every warpgroup waited for its last dV, dK)
#pragma unroll
                for (int kk = 0; kk < kSN / 16; ++kk) {
                    stmatrix_x4(smem + Shape::kPOffset + pt_store_offset(kk), p_frag[0][kk]);
                    stmatrix_x4(smem + Shape::kDstOffset + pt_store_offset(kk), ds_frag[0][kk]);
                }
            }
            if constexpr (kDropout && !kSharedKeys && kDropPacked < 2) {
                // dropout: per element, 16-bit stores (stmatrix's four-register operand makes ptxas
                // spill this kernel at d128, nvcc 13.0; kDropPacked 1's too, 8 bytes; kDropPacked 2
                // does not: dropout_transposed.cuh kOpaqueKeys); query 16kk + 8·(r / 2) + 2t (+1), key
                // warp_key + g + 8·(r % 2), the offsets recomputed (the dropout state takes registers)
#pragma unroll
                for (int kk = 0; kk < kSN / 16; ++kk)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const u32 v = ds_frag[0][kk][r];
                        const u32 rows = (kk * 16 + 8 * (r / 2)) * 128;  // whole swizzle periods
                        const u32 off_lo = swizzled_offset(2 * t, warp_key + g + 8 * (r % 2), kBM);
                        const u32 off_hi = swizzled_offset(2 * t + 1, warp_key + g + 8 * (r % 2), kBM);
                        *reinterpret_cast<u16*>(ds_smem_ptr + ds_buf + rows + off_lo) = u16(v & 0xFFFFu);
                        *reinterpret_cast<u16*>(ds_smem_ptr + ds_buf + rows + off_hi) = u16(v >> 16);
                    }
            } else {
                // (with softcap, ALiBi or kOverlapSdp's live dPᵀ the lane's address is recomputed
                // here, not kept across the loop: their state takes that register)
                constexpr bool kRecompute = ScoreMod<kSoftcap, kAlibi>::kOn || kOverlapSdp || kSAhead;
                const u32 addr = kRecompute ? ds_store_lane() : ds_store_addr;
#pragma unroll
                for (int kk = 0; kk < kSN / 16; ++kk) stmatrix_x4_trans(addr + ds_buf + kk * 16 * 128, ds_frag[0][kk]);
            }
            // dV and dK done: their operands (the Pᵀ, dSᵀ fragments) are never live together with the
            // dQ part's accumulators, which keeps d128 under the register budget. kDqEarly: not
            // waited for here; the dQ GEMM goes in behind them (the tensor cores do not drain at
            // the barrier below) and one wait covers the three
            if constexpr (!kDqEarly) {
                wgmma_wait<0>();
                reg_fence(dk_acc);
                reg_fence(dv_acc);
            }
            fence_proxy_async_smem();                               // generic stores -> wgmma's reads
            named_barrier_sync(1, kConsumerThreads);                // all of dS is written

            if constexpr (kSharedKeys) {
                // ---- dV_j += Pᵀ dO_i, dK_j += dSᵀ Q_i for this warpgroup's kDkvN columns (SS: Pᵀ,
                // dSᵀ of all BM queries from shared memory, K-major; dO_i, Q_i MN-major from its first
                // column chunk; queries 16kk..16kk+15 per step), waited for with the dQ part ----
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < kBM / 16; ++kk) {
                    const u32 a_off = (kk / 4) * Shape::kKVChunkBytes + (kk % 4) * 32;
                    Wgmma<kDkvN, Elem>::template ss<1>(dv_acc, fresh(p_desc).at(a_off), do_t_desc.at(q_off + kk * 16 * 128), 1);
                }
#pragma unroll
                for (int kk = 0; kk < kBM / 16; ++kk) {
                    const u32 a_off = (kk / 4) * Shape::kKVChunkBytes + (kk % 4) * 32;
                    Wgmma<kDkvN, Elem>::template ss<1>(dk_acc, fresh(dst_desc).at(a_off), q_t_desc.at(q_off + kk * 16 * 128), 1);
                }
                wgmma_commit();
            }

            if constexpr (kSharedKeys) {
                // ---- dQ_i part = dS K_j, this warpgroup's kDqN columns in 64-column pieces: one
                // piece's accumulators live at a time next to dK_j, dV_j (128 + 32 registers; the whole
                // part's 64 made ptxas spill), each added by red.add as soon as it is done (the
                // additions drain while the next piece runs). Deterministic: the turn is taken once
                // for both pieces. dq_bulk and dq_writer do not fit in shared memory here. ----
                static_assert(!kDqBulk, "shared keys (head dim 256): dQ by red.add or the slot staging (dq_writer)");
                int* turn = kDeterministic ? p.dq_semaphore + bh * (p.seqlen_q_rounded / 16) + m_block : nullptr;
                float* dq_rows = p.dq_accum + ((kVarlen ? ws_row0() : bh * p.seqlen_q_rounded) + row0
                                               + warp * 16) * p.head_dim_rounded + dq_col0;
#pragma unroll
                for (int piece = 0; piece < Shape::kDqN / 64; ++piece) {
                    float dq_part[32];
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < kBN / 16; ++kk) {
                        const u32 a_off = (kk / 4) * Shape::kQChunkBytes + (kk % 4) * 32;
                        Wgmma<64, Elem>::template ss<1>(dq_part, fresh(ds_desc).at(a_off),
                                                        fresh(k_t_desc).at(piece * Shape::kKVChunkBytes + kk * 16 * 128), kk > 0);
                    }
                    wgmma_commit();
                    wgmma_wait<0>();                                // (piece 0: dV, dK too: Q_i, dO_i all read)
                    reg_fence(dq_part);
                    if (piece == 0) {
                        reg_fence(dk_acc);
                        reg_fence(dv_acc);
                        // this thread is done with the slot: it may be refilled (kSlotDq: once the
                        // writer warp has read dQ_i's part too, its own arrival)
                        mbarrier_arrive(q_empty(slot));
                        if constexpr (kCluster)                     // (by the partner too)
                            if (it + kStages < n_iters)
                                mbarrier_arrive_remote(mapa_shared(q_empty(slot), cluster_ctarank() ^ 1u));
                        if (kDeterministic) {   // this CTA's turn at this Q block (as below)
                            const int first = kWindow ? band.template kv_block_begin<kBM, kBN>(row0) : 0;
                            if (ctid == 0) while (ld_acquire_gpu(turn) != n_block - first) {}
                            named_barrier_sync(1, kConsumerThreads);
                        }
                    }
                    if constexpr (kSlotDq) {
                        // kSlotDq: into boxes 4wg + 2·piece, + 1 of the staging in this slot
                        // (Sm90BwdSlotDqStage: this warpgroup's dV, dK, the last readers of those
                        // chunks, are done), stored as the kDqWriter tile below
                        store_slot_dq_r2s<Sm90BwdSlotDqStage<Shape>>(smem_ptr, smem, q_off, 4 * wg + 2 * piece,
                                                                     dq_part, warp, g, t);
                    } else {
#pragma unroll
                        for (int j = 0; j < 4; ++j)
                            red_add_tile_16x16(dq_rows + piece * 64 + j * 16, p.head_dim_rounded,
                                               reinterpret_cast<const float (&)[2][4]>(dq_part[8 * j]), g, t);
                    }
                }
                if constexpr (kSlotDq) {
                    fence_proxy_async_smem();                       // generic stores -> the bulk op's reads
                    named_barrier_arrive(kDqFullBar + (it & 1), kDqBarThreads);
                }
                if (kDeterministic) {  // pass the turn on once every thread's additions are visible
                    __threadfence();
                    named_barrier_sync(1, kConsumerThreads);
                    if (ctid == 0) red_release_add_gpu(turn, 1);
                }
                continue;
            }

            // ---- dQ_i part = dS K_j: this warpgroup's 64 rows x kDqN columns (kDqSwap: dQ_iᵀ =
            // K_jᵀ dSᵀ, its kDqN = 64 columns x BM queries; A = K_j's chunk MN-major, the same
            // descriptor as B's below; B = dS K-major, all BM rows) ----
            reg_fence(dq_acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kBN / 16; ++kk) {
                const u32 a_off = (kk / 4) * Shape::kQChunkBytes + (kk % 4) * 32;
                if constexpr (kDqSwap)
                    WgmmaTransA<kBM, Elem>::ss(dq_acc, k_t_desc.at(kk * 16 * 128), ds_desc.at(ds_buf + a_off), kk > 0);
                else
                    Wgmma<Shape::kDqN, Elem>::template ss<1>(dq_acc, ds_desc.at(ds_buf + a_off), k_t_desc.at(kk * 16 * 128), kk > 0);
            }
            wgmma_commit();
            if constexpr (kDkLate) {
                issue_dk();
                wgmma_wait<1>();                                    // the dQ part (dV too; dK may run)
            } else if (kSAhead && it + 1 < n_iters) {
                // the next Q block's Sᵀ behind the dQ GEMM (its slot's fill waited for first): the
                // tensor cores run it while this thread stores the dQ part; wait for the dQ part only
                const int next = slot + 1 == kStages ? 0 : slot + 1;
                mbarrier_wait(q_full(next), next == 0 ? phase ^ 1u : phase);
                issue_s(next);
                wgmma_wait<1>();                                    // the dQ part (kDqEarly: dV, dK too)
            } else {
                wgmma_wait<0>();                                    // the dQ part: Q_i, dO_i all read
            }
            reg_fence(dq_acc);
            if constexpr (kDqEarly && !kDkLate) {
                reg_fence(dk_acc);
                reg_fence(dv_acc);
            }
            if constexpr (!kDkLate) mbarrier_arrive(q_empty(slot));  // the slot may be refilled

            // ---- dQ accumulator += dQ part (fp32 in global memory) ----
            if constexpr (kDqWriter) {
                // to tile it % kBufs of the staging (Sm90BwdDqWriterStage), once the writer warp has
                // handed it back (from the kBufs-th Q block on), then signal the writer: it issues the
                // bulk reduce-adds while the consumers go on to the next Q block. Element (row, col)
                // of the BM x kHeadDim part: box col / 32, row, 16-byte unit (col % 32) / 4 ^ row % 8.
                // This thread's rows are g (+ 8) past a multiple of 8 and its columns col = dq_col0 +
                // 8nt + 2t (+ 1), dq_col0 a multiple of 32 (a box): unit 2·(nt % 4) + t / 2, i.e.
                // 2·(nt % 4) ^ (t / 2), so the swizzled unit is 2·(nt % 4) ^ (t / 2 ^ g). A half warp's
                // float2 stores (rows g = 0..3, t / 2 = 0, 1) would fill only 4 units, each twice: a
                // 2-way bank conflict. So the threads of odd rows g store fragment nt ^ 2 where the
                // others store nt (a select per element, in pairs nt, nt ^ 2 of the same box): their
                // unit gains ^ 4, and the half warp's 8 units are all distinct.
                static_assert(Shape::kDqN % 32 == 0, "nt ^ 2 pairs within a 32-column box");
                const int q = kDynamic ? q_done + it : it;          // the CTA's Q block count
                const int buf = DqW::kBufs == 1 ? 0 : q % 2;
                if (q >= DqW::kBufs) {
                    if constexpr (kDynamic)
                        mbarrier_wait(dq_empty(buf), u32(q / DqW::kBufs - 1) & 1);
                    else
                        named_barrier_sync(kDqEmptyBar + buf, kDqBarThreads);
                }
                if constexpr (kDqSwap) {
                    // dQ_iᵀ's register 4nt + 2·half + e: column col = dq_col0 + 16·warp + g + 8·half,
                    // query 8nt + 2t + e, i.e. row 8nt + 2t + e of box col / 32, 16-byte unit
                    // (col % 32) / 4 ^ (2t + e), word col % 4. A warp's 32 stores of one register:
                    // 8 columns (2 units) x 4 rows whose swizzles differ: 8 distinct units, 32 banks.
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int col = dq_col0 + warp * 16 + g + 8 * half;
                        unsigned char* base = smem_ptr + DqW::kOffset + buf * DqW::kTileBytes
                                              + (col / 32) * DqW::kBoxBytes + (col % 4) * 4;
                        const int unit = (col % 32) / 4;
#pragma unroll
                        for (int nt = 0; nt < kBM / 8; ++nt)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const int q = 8 * nt + 2 * t + e;
                                *reinterpret_cast<float*>(base + q * 128 + ((unit ^ (2 * t + e)) << 4))
                                    = dq_acc[4 * nt + 2 * half + e];
                            }
                    }
                }
                const bool odd = g % 2;
                const u32 sw = ((t / 2) ^ g ^ (odd ? 4 : 0)) << 4;
                unsigned char* tile = smem_ptr + DqW::kOffset + buf * DqW::kTileBytes + (dq_col0 / 32) * DqW::kBoxBytes
                                      + (dq_row_group * 64 + warp * 16 + g) * 128 + (t % 2) * 8;
#pragma unroll
                for (int nt = 0; nt < (kDqSwap ? 0 : Shape::kDqN / 8); ++nt) {
                    const int ns = nt ^ 2;                          // the fragment odd rows store here
                    const u32 off = (nt / 4) * DqW::kBoxBytes + (sw ^ ((2 * (nt % 4)) << 4));
#pragma unroll
                    for (int half = 0; half < 2; ++half)           // rows g, g + 8; columns col, col + 1
                        *reinterpret_cast<float2*>(tile + off + half * 8 * 128)
                            = make_float2(odd ? dq_acc[4 * ns + 2 * half] : dq_acc[4 * nt + 2 * half],
                                          odd ? dq_acc[4 * ns + 2 * half + 1] : dq_acc[4 * nt + 2 * half + 1]);
                }
                fence_proxy_async_smem();                           // generic stores -> the bulk op's reads
                named_barrier_arrive(kDqFullBar + buf, kDqBarThreads);
                if constexpr (kDkLate) {                            // dK done: Q_i read for the last time
                    wgmma_wait<0>();
                    reg_fence(dk_acc);
                    reg_fence(dv_acc);
                    mbarrier_arrive(q_empty(slot));                 // the slot may be refilled
                }
                continue;                                           // (the red.add path below is the default's)
            }
            if constexpr (kDqBulk) {
                // through shared memory: this warp's 16 rows x kDqN columns to its rows of the
                // staging tile, then lanes 0..15 add one row each by bulk reduce-add (the copy
                // engine does the additions; the warp goes on to the next Q block). The warp alone
                // writes and reads its rows, so a warp-level sync orders them.
                float* dq_rows = p.dq_accum + ((kVarlen ? ws_row0() : bh * p.seqlen_q_rounded) + row0
                                               + dq_row_group * 64 + warp * 16) * p.head_dim_rounded + dq_col0;
                const int stage_row0 = wg * 64 + warp * 16;        // this warp's first row of the stage
                unsigned char* stage_ptr = smem_ptr + DqStage::kOffset + stage_row0 * DqStage::kRowFloats * 4;
                if (lane < 16) bulk_wait_group_read<0>();          // the last Q block's row has been read
                __syncwarp();
#pragma unroll
                for (int nt = 0; nt < Shape::kDqN / 8; ++nt)
#pragma unroll
                    for (int half = 0; half < 2; ++half)           // rows g, g + 8; columns 8nt + 2t, + 1
                        *reinterpret_cast<float2*>(stage_ptr + ((g + 8 * half) * DqStage::kRowFloats + nt * 8 + 2 * t) * 4)
                            = make_float2(dq_acc[4 * nt + 2 * half], dq_acc[4 * nt + 2 * half + 1]);
                fence_proxy_async_smem();                           // generic stores -> the bulk op's reads
                __syncwarp();
                if (lane < 16) {
                    // row stage_row0 + lane; the accumulator rows are padded to seqlen_q_rounded (a
                    // multiple of 128 >= BM), so a ragged last Q block's extra rows land in padding
                    bulk_reduce_add_f32(dq_rows + lane * p.head_dim_rounded,
                                        smem + DqStage::kOffset + (stage_row0 + lane) * DqStage::kRowFloats * 4,
                                        DqStage::kRowBytes);
                    bulk_commit_group();
                }
                continue;                                           // (the red.add path below is the default's)
            }
            int* turn = kDeterministic ? p.dq_semaphore + bh * (p.seqlen_q_rounded / 16) + m_block : nullptr;
            if (kDeterministic) {  // wait for this CTA's turn at this Q block: K/V blocks in order
                // (under a window the K/V blocks that see Q block m_block start at its band's first,
                // kv_block_begin: the turns count from there, as in fa2_bwd)
                const int first = kWindow ? band.template kv_block_begin<kBM, kBN>(row0) : 0;
                if (ctid == 0) while (ld_acquire_gpu(turn) != n_block - first) {}
                named_barrier_sync(1, kConsumerThreads);
            }
            float* dq_rows = p.dq_accum + ((kVarlen ? ws_row0() : bh * p.seqlen_q_rounded) + row0
                                           + dq_row_group * 64 + warp * 16) * p.head_dim_rounded + dq_col0;
#pragma unroll
            for (int j = 0; j < Shape::kDqN / 16; ++j)
                red_add_tile_16x16(dq_rows + j * 16, p.head_dim_rounded,
                                   reinterpret_cast<const float (&)[2][4]>(dq_acc[8 * j]), g, t);
            if (kDeterministic) {  // pass the turn on once every thread's additions are visible
                __threadfence();
                named_barrier_sync(1, kConsumerThreads);
                if (ctid == 0) red_release_add_gpu(turn, 1);
            }
        }

        if constexpr (kDynamic) {
            if (n_iters > 0) {                                      // K_j, V_j read for the last time
                mbarrier_arrive(kv_empty);
                ++kv_loads;
            }
        }

        // ---- epilogue: dK_j = scale · Σ dSᵀ Q, dV_j = Σ Pᵀ dO ----
        // MHA: straight into dk, dv. GQA / MQA: fp32 per query head, summed by fa2_bwd_reduce_dkv.
        const bool grouped = p.nheads != p.nheads_kv;
        // kWideEpi (where wide_epi_fits): 16 bytes a lane (store_row_wide); otherwise 4 bytes a lane, below
        bool wide = false;
        if constexpr (kWideEpi) {
            wide = wide_epi_fits(p);
            if (wide) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int key = key0 + warp_key + g + 8 * half;
                    const bool inside = key < p.seqlen_k;
                    u16* dk = static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + key * p.dk_row_stride
                              + head * p.dk_head_stride;
                    u16* dv = static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + key * p.dv_row_stride
                              + head * p.dv_head_stride;
                    store_row_wide<kDkvN, Elem>(dk, dk_acc, half, p.softmax_scale, dkv_col0, p.head_dim, inside, t);
                    // (kDropPacked: dV_j's 1 / (1 - p) here, as below)
                    store_row_wide<kDkvN, Elem>(dv, dv_acc, half, kDropPacked ? p.dropout_scale : 1.f, dkv_col0,
                                                p.head_dim, inside, t);
                }
            }
        }
#pragma unroll
        for (int half = 0; half < 2 && !wide; ++half) {
            const int key = key0 + warp_key + g + 8 * half;
            if (key >= (kVarlen ? seq.seqlen_k : p.seqlen_k)) continue;
#pragma unroll
            for (int nt = 0; nt < kDkvN / 8; ++nt) {
                const int col = dkv_col0 + nt * 8 + 2 * t;          // (kSharedKeys: this warpgroup's columns)
                const float dk0 = dk_acc[4 * nt + 2 * half] * p.softmax_scale;
                const float dk1 = dk_acc[4 * nt + 2 * half + 1] * p.softmax_scale;
                // (kDropPacked: dV_j = Σ (Pᵀ ∘ Z) dO takes the 1 / (1 - p) here)
                const float dv_scale = kDropPacked ? p.dropout_scale : 1.f;
                const float dv0 = dv_acc[4 * nt + 2 * half] * dv_scale, dv1 = dv_acc[4 * nt + 2 * half + 1] * dv_scale;
                if (grouped) {
                    // kVarlen: (nheads, total_k) rows, the sequence's from k_start on (dkv_row_offset)
                    const i64 off = ((kVarlen ? dkv_row_offset<kVarlen>(p, batch, head, seq) : bh * p.seqlen_k) + key)
                                    * p.head_dim_rounded + col;
                    *reinterpret_cast<float2*>(p.dk_accum + off) = make_float2(dk0, dk1);
                    *reinterpret_cast<float2*>(p.dv_accum + off) = make_float2(dv0, dv1);
                } else if (col < p.head_dim) {
                    const int row = kVarlen ? seq.k_start + key : key;   // kVarlen: batch strides 0
                    u16* dk = static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + row * p.dk_row_stride
                              + head * p.dk_head_stride + col;
                    u16* dv = static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + row * p.dv_row_stride
                              + head * p.dv_head_stride + col;
                    *reinterpret_cast<u32*>(dk) = pack2<Elem>(dk0, dk1);
                    *reinterpret_cast<u32*>(dv) = pack2<Elem>(dv0, dv1);
                }
            }
        }
        if constexpr (!kDynamic) break;
        q_done += n_iters;
        const Sm90BwdTile next = ring_take();
        if (next.n_block < 0) break;
        enter_tile(next);
        tile_range();
    }   // the tile loop
    // kDqBulk: this thread's bulk additions complete before the CTA (and its shared memory) ends
    if constexpr (kDqBulk) {
        if (lane < 16) bulk_wait_group<0>();
    }
    if constexpr (kDqConvert) convert_done_pairs();
}

template <int kBM, int kBN, int kStages, int kConsumers, int kHeadDim, class Elem, bool kCausal,
          bool kDeterministic, bool kWindow = false, bool kSoftcap = false, bool kAlibi = false,
          bool kDropout = false, bool kDqBulk = false, bool kOverlapSdp = false, bool kDqWriter = false,
          bool kVarlen = false, bool kLpt = false, bool kDynamic = false, bool kDsDouble = false,
          bool kSAhead = false, bool kDqEarly = false, bool kQRotate = false, bool kDkLate = false,
          bool kFragPin = false, bool kRoles = false, bool kDqConvert = false, bool kDqFirst = false,
          bool kWideEpi = false, int kDropPacked = 0, int kCapFold = 0, int kDqTail = 0>
__global__ void __launch_bounds__((kConsumers + 1) * 128, 1)
sm90_bwd(const __grid_constant__ Sm90BwdParams p) {
    sm90_bwd_body<kBM, kBN, kStages, kConsumers, kHeadDim, Elem, kCausal, kDeterministic, kWindow, kSoftcap, kAlibi,
                  kDropout, kDqBulk, kOverlapSdp, kDqWriter, kVarlen, kLpt, kDynamic, kDsDouble, false,
                  kSAhead, kDqEarly, kQRotate, kDkLate, kFragPin, kRoles, kDqConvert, kDqFirst, kWideEpi,
                  kDropPacked, kCapFold, kDqTail>(p);
}

// kDqTail's convert (Sm90BwdDqTail above): dQ = scale · accumulator, Sm90BwdDqQueue::kRows rows of one
// (head, batch) pair a job, drawn by ticket in pair-major order, kCtasPerSm CTAs an SM (one's loads run
// while another converts or waits). Thread 0 draws the next job's ticket as the CTA starts a job (the
// atomic's round trip hidden by the job) and, once the job is done, waits for the next job's pair (its
// n_kv = ceil(seqlen_k / kBN) K/V tiles counted) before the CTA's barrier: one barrier a job. Every CTA
// ends with grid_dependency_wait, so that the grid completes after the main kernel: the stream's next
// kernels (GQA's reduce, the caller's) see dK, dV too.
template <class Elem, int kBN>
__global__ void __launch_bounds__(Sm90BwdDqTail::kThreads, Sm90BwdDqTail::kCtasPerSm)
sm90_bwd_dq_tail(const __grid_constant__ Sm90BwdParams p) {
    using T = Sm90BwdDqTail;
    __shared__ int job_s[2];
    int* const c = p.tile_counter;
    const int n_pairs = p.batch * p.nheads, n_kv = (p.seqlen_k + kBN - 1) / kBN;
    const Sm90BwdDqQueue jobs(c, n_pairs, p.seqlen_q);       // (its job numbering and row count only)
    const int n_jobs = n_pairs * jobs.n_chunks;
    const int tid = threadIdx.x;
    int seen_pair = -1;                                      // thread 0: the last pair found complete
    // thread 0: the pair of `job` complete (its sums final: acquire, then the CTA's barrier for the others)
    auto wait_pair = [&](int job) {
        const int pair = job / jobs.n_chunks;
        if (job < n_jobs && pair != seen_pair) {
            while (ld_acquire_gpu(c + T::kPairCount0 + pair) < n_kv) __nanosleep(256);
            __threadfence();
            seen_pair = pair;
        }
    };
    if (tid == 0) {
        job_s[0] = atomicAdd(c + T::kTicket, 1);
        wait_pair(job_s[0]);
    }
    __syncthreads();
    // (job_s[k ^ 1] is written at the end of the iteration that reads job_s[k], before its barrier)
    for (int k = 0;; k ^= 1) {
        const int job = job_s[k];
        if (job >= n_jobs) break;
        int next = 0;
        if (tid == 0) next = atomicAdd(c + T::kTicket, 1);
        sm90_bwd_convert_dq_job<Elem>(p, jobs, job, tid, T::kThreads);
        if (tid == 0) {
            job_s[k ^ 1] = next;
            wait_pair(next);
        }
        __syncthreads();
    }
    if (tid == 0 && atomicAdd(c + T::kFinished, 1) == int(gridDim.x) - 1) {   // the grid's last: reset
        for (int i = 0; i < n_pairs; ++i) atomicExch(c + T::kPairCount0 + i, 0);
        atomicExch(c + T::kTicket, 0);
        atomicExch(c + T::kFinished, 0);
    }
    grid_dependency_wait();
}

// kCluster's entry point: a cluster of 2 CTAs (adjacent K/V blocks); kClusterSize (2) leads the
// template arguments so that its instantiations differ from sm90_bwd's in them. (Only where clusters
// exist: fa2_bwd's helper kernels of this file also compile for sm_80.)
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
template <int kClusterSize, int kBM, int kBN, int kStages, int kConsumers, int kHeadDim, class Elem, bool kCausal,
          bool kDeterministic, bool kWindow, bool kSoftcap, bool kAlibi, bool kDropout, bool kDqBulk,
          bool kOverlapSdp, bool kDqWriter, bool kVarlen, bool kLpt, bool kDynamic, bool kDsDouble,
          bool kRoles = false, bool kSAhead = false>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__((kConsumers + 1) * 128, 1)
sm90_bwd_cluster(const __grid_constant__ Sm90BwdParams p) {
    static_assert(kClusterSize == 2, "sm90_bwd_cluster: clusters of 2 CTAs");
    sm90_bwd_body<kBM, kBN, kStages, kConsumers, kHeadDim, Elem, kCausal, kDeterministic, kWindow, kSoftcap, kAlibi,
                  kDropout, kDqBulk, kOverlapSdp, kDqWriter, kVarlen, kLpt, kDynamic, kDsDouble, true,
                  kSAhead, false, false, false, false, kRoles, false, false>(p);
}
#endif

}  // namespace cuflash
