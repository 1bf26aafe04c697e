// sm90_fwd.cu: FlashAttention forward for Hopper (sm_90a only), built the FlashAttention-3
// way: TMA loads, asynchronous wgmma, a producer warpgroup and consumer warpgroups, and a
// software pipeline that runs the softmax while the tensor cores compute.
//
//   O = softmax(Q Kᵀ · scale, causal mask) V,   LSE = log Σ_j exp(S_ij)   (per query row)
//
// A tile is one Q block Q_i (kBM = 64 · kConsumers query rows) of one (head, batch); a CTA of
// 1 + kConsumers warpgroups of 128 threads computes tiles blockIdx.x, + gridDim.x, ...: one
// tile when the grid has a CTA per tile, or, persistent (kPersistent: a CTA per SM), a
// strided share of them, with the producer loading the next tile's Q and K/V while the
// consumers finish the last one (its last P V and its epilogue). Tiles are numbered Q block
// fastest, from the last Q block (under a causal mask, the heaviest) to the first, then by
// head and batch: the CTAs working at the same time share a head's K/V in L2. The K/V
// blocks are visited from the last to the first, as in fa2_fwd, so the few masked ones
// (ragged end, causal diagonal) come first.
//
// The dynamic scheduler (kDynamic, on the persistent grid): a CTA's first tile is blockIdx.x, and
// each next one is claimed when it is needed, so a CTA that drew light tiles takes more of them
// (the static stride gives every CTA its share up front, however long its tiles run). The
// producer thread claims (atomicAdd on a counter in global memory, Sm90TileRing: why a launch
// makes exactly n_tiles claims and who resets the counter) right after issuing the last loads of
// its current tile, hands the index to the consumers through a 2-slot ring in shared memory with
// full / empty mbarriers, and goes on loading that tile's Q and K/V while the consumers finish the
// current one. The tile order differs from the static one (sm90_sectioned_tile): (head, batch)
// pairs in sections whose K/V fit in L2 (the host's sched_section), inside a section the Q block
// slow and from the last: the heaviest causal tiles are claimed first and the light ones fill the
// end of the launch, and the CTAs running at the same time share a few heads' K/V in L2.
//
// The TMA-store epilogue (kTmaStore): O = acc / l goes into a per-warpgroup staging tile in shared
// memory (the 128-byte swizzle of the tensor maps) and one thread of the warpgroup stores it with
// a TMA store (tma_o: box 64 columns x 64 rows, clipped at seqlen_q and head_dim), so the
// warpgroup starts its next tile without waiting for its 64 x head_dim global stores; the thread
// waits for the store to have read the tile (bulk_wait_group_read) before the next epilogue
// rewrites it. LSE is stored from registers either way.
//
// Producer (warpgroup 0): thread 0 issues every copy, the other 127 threads exit. It loads Q_i
// once, then K_j and V_j by TMA into a ring of kStages shared-memory slots.
//
// mbarriers, the producer / consumer handshake: Q full, Q empty, and per slot K full, V full,
// K empty, V empty (separate for K and V, so a slot's next K tile can load while its V_j is
// still read). Q empty: every consumer thread arrives once its last S = Q K_jᵀ of the tile
// has completed, so that the next tile's Q may load. Phases count across the CTA's tiles:
// the q-th tile with keys uses Q's phase q & 1, and the ring's iteration counter runs on.
//   full   one arrival (the producer's expect_tx with the tile's bytes) and the bytes
//          themselves (TMA's complete_tx): the phase completes when the tile has landed
//   empty  kConsumers · 128 arrivals, one per consumer thread after its last read of the tile:
//          K_j as soon as S_j = Q K_jᵀ has completed, V_j after O += P_j V_j has
//   phases the n-th fill of a slot (n = iter / kStages) is waited for with parity n & 1; before
//          refilling it the producer waits for release n - 1, parity (n - 1) & 1
//
// Consumers (warpgroups 1..kConsumers; consumer wg owns query rows 64·wg..64·wg+63, 16 per
// warp). S_j and O are fp32 wgmma accumulators in registers. FA3's pipeline, with j counting
// K/V blocks in loop order and n = n_blocks:
//   j = 0       issue S_0 = Q K_0ᵀ, wait, softmax -> P_0 (O is still zero: nothing to rescale)
//   j = 1..n-1  issue S_j = Q K_jᵀ            (wgmma SS: both operands in shared memory)
//               issue O += P_{j-1} V_{j-1}     (wgmma RS: P from registers, V in shared memory)
//               wait for S_j (wgmma groups complete in order: P_{j-1} V_{j-1} may still run)
//               mask S_j if the block needs it (mask.cuh); softmax_step (softmax.cuh, exp2):
//               P_j, m, l and alpha_j = exp(scale · (m_{j-1} - m_j)), all while the tensor
//               cores run P_{j-1} V_{j-1}
//               wait for P_{j-1} V_{j-1}; O *= alpha_j (softmax_rescale: only now, because the
//               GEMM was writing O); P_j to 16-bit A fragments
//   end         O += P_{n-1} V_{n-1}, wait; O / l and LSE stored from registers
//
// Pingpong (kPingpong, 2 or 3 consumers): the consumer warpgroups also take turns, round robin,
// to issue their GEMMs (one turn per step of the schedule above: j = 0, each j, end), so that
// one warpgroup's softmax runs under the others' GEMMs. Turns are passed on named barriers
// 1..kConsumers (0 is __syncthreads'): barrier 1 + w, over 256 threads, is where warpgroup w
// waits (bar.sync, its 128 threads) for its predecessor (w - 1 mod kConsumers) to hand over
// (bar.arrive, 128 threads). Why arrivals equal waits: all consumer warpgroups share the CTA's
// n_blocks, so each takes T = n_blocks + 1 turns and waits T times. Warpgroup w > 0 receives
// its predecessor's T hand-overs. Warpgroup 0 receives the last warpgroup's start() arrival
// (which gives it the first turn) plus that warpgroup's first T - 1 hand-overs: its last one,
// end(true), is skipped. So no barrier is left half arrived. The turns rotate strictly, so a
// barrier never holds more than one pending hand-over. With several tiles T sums over the
// CTA's tiles with keys, and end(true) marks the last turn of the last one.
//
// Registers: setmaxnreg moves them from the producer, which only issues TMA, to the consumers,
// which hold S and O. FA3's splits, producer / consumer per thread: 56 / 256 with 1 consumer,
// 24 / 240 with 2, 32 / 160 with 3.
//
// Shared memory (base aligned to 1024 bytes, the period of the 128-byte swizzle; every tile is
// stored as kChunks = ceil(head_dim / 64) column chunks of rows x 64 elements, 128 bytes a row,
// swizzled as TMA writes it and wgmma reads it):
//   q_smem [kChunks][BM][64], k_smem / v_smem [kStages][kChunks][BN][64], (kTmaStore) the O
//   staging tiles [kConsumers][kChunks][64][64], (kPSmem) the P tiles [kConsumers][ceil(BN / 64)]
//   [64][64], then the mbarriers (Q full, Q empty; K full,
//   V full, K empty, V empty, kStages each) and (kDynamic) the tile ring (2 full, 2 empty
//   mbarriers, 2 int32 tile indices).
//
// Head dim 96 (exact, not d128 with zeros): the shared-memory layout is d128's, two 64-column
// chunks, the second one half used: TMA loads a full 64-column box into it and fills columns
// 96..127 with zeros (past the tensor map's head dim; the box bytes, zeros included, are what
// expect_tx counts). Only the compute shrinks: S = Q Kᵀ takes 96 / 16 = 6 k16 steps (chunk 0's
// four, chunk 1's first two; no step reads the zero columns), O += P V is one wgmma with N = 96
// (m64n96k16) whose B operand, V_j MN-major, spans chunk 0 and the first half of chunk 1: the
// descriptor is d128's (LBO = one chunk, SBO = 8 rows), the instruction just stops at column 95.
// O holds 96 columns of accumulators (48 registers per thread instead of 64), and the epilogue
// stores only the real columns. Why not a 64-byte swizzle with three 32-column chunks (an exact
// 192-byte row): it needs other tensor maps, descriptors and alignment than every other head
// dim; d128's layout keeps one layout for the family at the cost of 64 bytes of shared memory
// per row that hold zeros (d96 tiles are sized by the d128 shared-memory rule).
//
// Layouts of the tensors: Sm90FwdParams in params_sm90.cuh. The parts the FP8 forward
// (sm90_fwd_fp8.cu) shares with this kernel are in sm90_fwd_common.cuh: the tile numbering
// (Sm90Tile), the pingpong turns (Pingpong), the mbarriers (Sm90FwdBars), the producer's loads of
// Q and of a K/V ring slot (sm90_load_q, sm90_fill_kv, with the tiles' TMA boxes: Sm90RowTile),
// the consumers' K/V loop of the pipeline below (sm90_consume_blocks), to which this file gives
// its GEMMs, softmax and features, and the register epilogue (sm90_store_o_lse).
//
// Template parameters (cuflash/families/sm90_fwd.py Sm90FwdConfig is the host-side mirror; it
// validates the same rules before compiling):
//   kBM        query rows of the Q block: 64 · kConsumers
//   kBN        keys of a K/V block: a multiple of 16 in 64..192 (wgmma n; P's k16 steps)
//   kStages    K/V ring slots, >= 2
//   kConsumers consumer warpgroups, 1, 2 or 3
//   kPingpong  consumer warpgroups take turns with their GEMMs (needs 2 or 3 consumers)
//   kPersistent the grid has one CTA per SM (the host sizes it); the code is the same for a
//              CTA per tile, the flag only names the kernel for the host's launch
//   kHeadDim   64, 96, 128, 192 or 256 (the real head dim, params.head_dim, may be smaller: TMA
//              fills the columns past it with zeros and the store skips them)
//   Elem       bf16 or fp16; accumulation in fp32
//   kCausal    bottom-right aligned causal mask
//   kWindow, kSoftcap, kAlibi  as in fa2_fwd.cu: sliding window (mask.cuh BandMask; K/V blocks
//              outside the band are neither loaded nor computed), softcap and ALiBi (score.cuh)
//   kDropout   attention dropout as in fa2_fwd.cu (philox.cuh): after softmax_step has summed the
//              undropped P_j into l (so l and the LSE are plain attention's, FA2's Algorithm 2),
//              P_j ∘ Z feeds O += P_j V_j and the epilogue's 1 / l takes the 1 / (1 - p). Z is
//              the canonical keep mask of (rng_state, batch·nheads + head, query row, key
//              column), the one fa2_fwd draws and fa2_bwd regenerates: per warp the wgmma
//              accumulator layout is mma.sync's (rows g, g + 8 of the warp's 16, columns
//              8·nt + 2t + e), so Dropout::zero_dropped serves both families (one Philox call
//              per 16 elements of a thread, its own; BN a multiple of 32)
//   kEmuExp2   0..4: that many quarters of S's 8-column tiles compute P's exp2 on the FMA / ALU
//              pipes (exp2_emu.cuh: a polynomial, FlashAttention-4's trick) instead of the SFU's
//              ex2.approx, which softcap's tanh.approx also needs; 0 (the default) is the
//              plain kernel, the same code as before the parameter existed. With kFoldCap the
//              folded step's exp2s (softmax_fold.cuh softmax_row_update) take it
//   kDynamic   the dynamic scheduler (needs kPersistent; params.tile_counter, params.sched_section)
//   kTmaStore  the TMA-store epilogue (params.tma_o)
//   (kDynamic and kTmaStore false, the defaults: the code of the kernel before they existed)
//   kQDouble   two Q buffers: the producer loads the next tile's Q_i while the consumers still
//              compute with the current one (its buffer is the one of the tile before, released
//              long ago), so a tile's first S = Q K_0ᵀ does not wait for Q's load after the last
//              one's S; costs one more Q block of shared memory (BM x 128 bytes a chunk) and two
//              mbarriers. false (the default): one buffer, the code of the kernel before it existed
//   kPSmem     P through shared memory (FA3's choice for its d64 tile, 192 x 192): after the softmax
//              each warp writes its 16 rows of P_j, 16-bit, into its warpgroup's P tile (stmatrix;
//              64 x BN, K-major, 128-byte swizzled like Q) and O += P_j V_j is a wgmma SS. No
//              register holds P's A fragments (BN / 4 per thread), which is what lets three
//              consumer warpgroups (160 registers each) take BN 192 at head dim 64; the price is
//              the P tile's shared memory (BN · 128 bytes per warpgroup) and its stores. false
//              (the default): the code of the kernel before it existed
//   kDropPacked (kDropout only) the keep mask applied to P_j's packed 16-bit A fragments after
//              pack_p (dropout_packed.cuh: a byte permute and an AND per two elements) instead of
//              to the fp32 P_j before it; the same mask, the same bits. Not with kPSmem. false
//              (the default): the code of the kernel before it existed
//   kDropEarly (kDropPacked only) P_j's Philox rounds run in the wait for S_j's wgmma (the mask
//              depends on coordinates only) and leave the keep flags (dropout_packed.cuh
//              draw_keep_flags): 1, as byte signs, one register per 4 elements, and after pack_p a
//              permute and an AND per two elements; 2, as the fragment words' masks, one register
//              per 2 elements, and an AND per two. The same mask, the same bits. 3: form 1 with the
//              counters for Philox words (no rounds), NOT the mask: timing only (what the rounds
//              cost; refused by the config unless sm90_fwd.py DROP_EARLY_TIMING). 4: form 1's flags
//              drawn by the producer warpgroup's warps 1-3 (otherwise idle) into shared memory, one
//              K/V block ahead at most (Shape kGenBytes, full / empty mbarriers), the consumers load
//              them (16-byte loads) in the wait for S_j: their warps carry no Philox round (static
//              tile order only: not with kDynamic or kVarlen). 5 and 6: timing forms, NOT the
//              mask (refused like 3 unless DROP_EARLY_TIMING): 5, no draw (every flag "kept", one
//              pinned register per 4 elements) but the permute and AND after pack_p; 6, neither
//              (the kernel's dropout is then its epilogue's 1 / (1 - p)): what the flags' application
//              and the rest of the dropout kernel cost. 0 (the default): the code of the kernel
//              before it existed
//   kTreeMax   the online softmax's step with shorter dependency chains (softmax_tree.cuh: both
//              rows' maxima as pairwise trees, their shuffles side by side, two partial row sums),
//              so that the block's first ex2 issues sooner; not with kEmuExp2. false (the
//              default): softmax.cuh's softmax_step, the code of the kernel before it existed
//   kVarlen    variable-length batches (varlen.cuh): q, k, v, o packed as (total, heads, d),
//              sequence b's rows from cu_seqlens[b] on. Tiles are still (Q block, head,
//              sequence), the grid sized for the longest sequence; a tile past its sequence's
//              end has no K/V block and stores nothing (a CTA of one such tile leaves at once,
//              the persistent loop skips it). The tensor maps span the whole packed tensors and
//              a box starts at row cu_seqlens[b] + offset, so TMA's zero fill only starts at the
//              packed tensor's end: the rows past a sequence's end that a box covers are the next
//              sequence's. Hence, per tile, the mask is built from the sequence's own lengths
//              (the ragged-end mask hides its keys >= seqlen_k; causal and window are
//              bottom-right per sequence), and the epilogue stores only rows < seqlen_q (the
//              other Q rows computed garbage from the next sequence); P is 0 on the hidden keys,
//              so the next sequence's V rows add 0 · V to O. LSE in flash-attn's varlen layout
//              (nheads, total_q). Dropout and ALiBi are keyed by the sequence index and the rows
//              within the sequence, as in fa2_fwd's varlen kernel
//   kLazyRescale the running max moves only when a block's max exceeds it by more than 2^8 in P
//              (softmax_fold.cuh: FlashAttention-4's lazy rescale), and O *= alpha runs only for the
//              threads whose rows moved; not with kDropout or kEmuExp2. With kLazyRescale or
//              kFoldCap, ALiBi's bias takes fp32 distances (softmax_fold.cuh FoldedScoreMod: no
//              integer conversion per score on the SFU's pipe)
//   kFoldCap   0..4 (kSoftcap only): 1, S kept as t = tanh(S·softcap_in) with the softmax's and
//              the LSE's scales times softcap_out (softmax_fold.cuh FoldedScoreMod: one multiply per
//              score fewer); 2, also the row max on the raw S before the tanhs (tanh is increasing;
//              without kAlibi, else as 1), the masked blocks masked before the max and again after
//              the tanh (tanh(-inf) = -1); 3, as 2, but where the host allows it for the call's cap
//              (params.softcap_fixed_m <= 1: 2·softcap·log2(e) <= 100, so P = exp2(k (t - 1)) >=
//              2^-100 never underflows; up to 160 in bf16 the host lowers the fixed value below 1 so
//              that P spans [2^-100, 2^60] at most: sm90_fwd.py FIXED_MAX_LOG2_TOP) the running max is
//              that fixed value (t <= 1), no row max
//              and, with kLazyRescale, no O rescale after the first block (and O normalized by the
//              sum of P as rounded for the P V GEMM, the LSE by l's: no P is exactly 1 there, so
//              O is a convex combination of V's rows by construction, O = V at one key; the sum
//              runs on the tensor cores beside O, kRowSumMma: ptx_sm90_rowsum.cuh); 4, as 3 with Q_i
//              prescaled by softcap_in in shared memory once per tile (softmax_fold.cuh
//              prescale_q: no multiply per score before the tanh; bf16 only; the host refuses it
//              outside timing: the forward's LSE then comes from the rounded Q·softcap_in, which no
//              backward recomputes). 2, 3 and 4 need
//              kLazyRescale. 0 and kLazyRescale false, the defaults: the code of the kernel
//              before they existed
//   kAlibiLinear ALiBi's bias as one FFMA per score (softmax_fold.cuh AlibiLinear): on blocks whose keys
//              lie on one side of the warp's diagonal keys (causal: all of them) the bias is
//              linear in the key, its per-row part goes into the softmax's exponent offset
//              (softmax_step_shift); blocks across the diagonal take the exact fp32 distance. kAlibi
//              alone (no kSoftcap, kDropout, kEmuExp2, kVarlen, kTreeMax). false, the default: the
//              code of the kernel before it existed
//   kRescaleFirst O *= alpha_j runs in the next step, right after S_{j+1} = Q K_{j+1}ᵀ is issued and
//              before O += P_j V_j (FA3's order for head dims above 128, RescaleOBeforeGemm): the
//              rescale's head_dim / 2 multiplies per thread then run while the tensor cores compute
//              S_{j+1}, not between the wait for P_{j-1} V_{j-1} and the next issue. O is stable
//              there (P_{j-1} V_{j-1} was waited for in step j); wgmma_fence orders the multiplies
//              before the P V wgmma reads O. Meant for the tiles without pingpong (with it the other
//              warpgroups' GEMMs fill that gap already). Not with kLazyRescale / kFoldCap. false
//              (the default): the code of the kernel before it existed
//   kTileOverlap the static persistent plain kernel (with or without pingpong): after issuing a
//              tile's last O += P V, each consumer issues the next tile's S_0 = Q' K'_0ᵀ in the same
//              turn (its Q' and K'_0 load while the last blocks run) and waits for the P V alone, so
//              S_0 runs on the tensor cores during the epilogue instead of after it: the
//              once-per-tile pipeline fill is hidden (short tiles, e.g. head dim 256 at 2k keys: 26
//              blocks per tile). The next tile's first step then only waits for S_0. With kWindow also
//              causal, with kTmaStore, kQDouble (S_0 reads the next tile's Q buffer) and kDynamic (the
//              next tile taken from the ring right there, behind the last P V: the producer claimed it
//              once it had issued this tile's last loads); every tile must have keys (a window's short
//              tiles, 9 K/V blocks at 1024 and BN 128: the host drops the flag per call where a tile has
//              none, sm90_fwd.py for_bounds). false (the default): the code of the kernel before it existed
//   kStreamTail the static persistent plain non-causal kernel with a balanced tail (sm90_tail.cuh:
//              the last n_tiles - G·(n_tiles / G - 1) tiles cut by K/V blocks into equal ranges
//              per CTA, a tile cut in two joined through fp32 partials in params.tail_partial;
//              a piece runs the tile loop below on its blocks [jb, je): n_end and n_blocks are the
//              piece's). false (the default): the code of the kernel before it existed
//   kPvOverlap the consumers' K/V loop rotated (sm90_fwd_common.cuh sm90_consume_blocks kRotate): the
//              same steps in the same order, block j's finish (the wait for P_{j-1} V_{j-1}, the V
//              release, O *= alpha_j, P_j's packing) at the head of the next iteration, so that
//              ptxas keeps the softmax of S_j above that wait and it runs under this warpgroup's own
//              P_{j-1} V_{j-1} GEMM, FA3's intra-warpgroup overlap (without it nvcc 13.0 puts the
//              wait first: the step overlaps only the other warpgroups' GEMMs). Plain calls only (no
//              window, softcap, ALiBi, dropout); measured no faster (sm90_fwd.py PV_OVERLAP's note).
//              false (the default): the code of the kernel before it existed
//   kMaskedCopy 0..2, with kFoldCap >= 3 (no kAlibi): the folded softcap step's masked blocks (the
//              causal diagonal's, a ragged end) run a copy of their own of the step, so that an
//              unmasked block's tanhs, exp2s and their FMA-pipe work are one basic block (with the
//              mask's branch between the tanhs and the exp2s, ptxas issues the block's tanhs in one SFU
//              burst, then its exp2s): 1, the fixed-max step; 2, the row-max step too. 0 (the
//              default): the code of the kernel before it existed
//   kRagKeys   0, or a multiple of 16 below kBN (plain non-causal fixed-length calls, not with
//              kTileOverlap / kStreamTail / kCluster / kPvOverlap): a tile's first K/V block in loop order,
//              the last one (n_end - 1), holds at most kRagKeys keys (seqlen_k - (n_end - 1)·kBN, checked per
//              tile at run time: else the full-width path), the others zero-filled by TMA and masked. Its
//              O += P V takes kRagKeys / 16 k16 steps, not kBN / 16 (P is 0 on the rest): d256 at 2k keys,
//              BN 80, 2048 = 25·80 + 48, 3 steps of 5 (0.8% of the tile's GEMM work). Its S GEMM stays
//              full width: an N = 64 wgmma into s_acc's first columns on that path made ptxas serialize
//              the kernel's wgmmas (C7515, nvcc 13.0). 0 (the default): the code of the kernel before
//              it existed
//   kPrefetch  the static persistent schedule's producer, once it has issued a tile's Q load, asks TMA to
//              bring the CTA's next tile's Q_i into L2 (ptx_sm90_prefetch.cuh: no shared memory, nothing
//              waited for), so that the next tile's Q load, issued when this tile's last S frees the
//              buffer, reads L2, not DRAM (the CTAs of a wave switch tiles together: their Q loads, 64 KB
//              each at d256, otherwise hit DRAM in one burst while the consumers wait for S_0; the next
//              tile's first K/V blocks are shared by the 16 CTAs of its head). Also the first kStages K/V
//              blocks: ptxas spilled in the producer's 24 registers (nvcc 13.0). Fixed lengths, not with
//              kDynamic / kStreamTail / kCluster / kVarlen. false (the default): the code of the kernel
//              before it existed
//   kSAhead    with kFoldCap >= 3 (softcap alone): S_{j+1} = Q K_{j+1}ᵀ issued before the softmax of S_j,
//              into a second accumulator, moved into s_acc once landed (sm90_consume_blocks_ahead,
//              below): the softmax never waits for its own S GEMM. Needs 3 stages
//              (K_{j+1} must be in by step j) and BN <= 112 (two S accumulators, O and P: BN 128
//              serializes the wgmmas for registers, C7512). Measured slower (sm90_fwd.py
//              SOFTCAP_DEFER_MAX's note): off. false (the default): the code of the kernel before it existed
//   kDeferMax  with kFoldCap >= 3, kLazyRescale (softcap, no ALiBi): the row-max step's exp2s from the
//              running max as it was, the block's max taken after them (softmax_fold.cuh
//              softmax_step_deferred), once every row of the warp has a max within DeferRangeLog2 of
//              t's bound (a warp vote after each step); m's move scales l at once and O one step
//              later, and O is normalized by the tensor cores' Σ P̃ (kRowSumMma), which keeps O's
//              scale. Measured slower (SOFTCAP_DEFER_MAX's note): off. false (the default): the code of
//              the kernel before it existed
//   kCluster   (the entry point sm90_fwd_cluster, __cluster_dims__(2, 1, 1); not a template parameter of
//              sm90_fwd) clusters of two CTAs on the static persistent grid: CTAs 2c and 2c + 1 take
//              tiles 2c + i·G and 2c + 1 + i·G, adjacent Q blocks of one (head, batch) at every step
//              (the host keeps G and the Q blocks per head even), so they walk the same K/V blocks; each
//              CTA's producer loads half of every K_j's and V_j's 64-column chunks by TMA multicast into
//              both CTAs (Sm90RowTile's kPair: one L2 read feeds two SMs), and a slot's empty mbarrier
//              counts the partner's consumer warps' releases too (Sm90FwdBars' kPair: remote arrivals,
//              none for the CTA's last kStages iterations, which nothing refills). A cluster barrier after the
//              mbarriers' init, before any multicast. Plain non-causal fixed-length calls only
//              (measurements: cuflash/families/sm90_fwd.py HEURISTIC_CLUSTER's note)
#include "ptx.cuh"
#include "ptx_sm90.cuh"
#include "params_sm90.cuh"
#include "tile.cuh"
#include "gemm.cuh"
#include "mask.cuh"
#include "score.cuh"
#include "softmax.cuh"
#include "philox.cuh"
#include "exp2_emu.cuh"
#include "softmax_tree.cuh"
#include "ptx_sm90_bulk.cuh"
#include "ptx_sm90_store.cuh"
#include "varlen.cuh"
#include "dropout_packed.cuh"
#include "softmax_fold.cuh"
#include "sm90_tail.cuh"
#include "sm90_fwd_common.cuh"
#include "ptx_sm90_rowsum.cuh"
#include "ptx_sm90_prefetch.cuh"

namespace cuflash {

template <int kBM, int kBN, int kStages, int kConsumers, int kHeadDim, bool kDynamic = false,
          bool kTmaStore = false, bool kPSmem = false, bool kQDouble = false, int kGenBytes = 0,
          int kOnesRegion = 0>
struct Sm90FwdShape {
    static constexpr int kThreads = (kConsumers + 1) * 128;
    // 64-column (128-byte) swizzle atoms; d96: two, the second half used (header)
    static constexpr int kChunks = (kHeadDim + 63) / 64;
    static constexpr int kQChunkBytes = kBM * 128;          // one column chunk of Q_i
    static constexpr int kKVChunkBytes = kBN * 128;         // one column chunk of K_j (or V_j)
    static constexpr int kQBytes = kChunks * kQChunkBytes;  // Q_i as TMA delivers it, zeros included
    static constexpr int kKVBytes = kChunks * kKVChunkBytes;  // one K_j (or V_j) tile
    // O's columns: the N of the P V wgmma and of the accumulators. The head dim (d96: 96, V's
    // B operand reading one and a half swizzle atoms; kChunks * 64 would run d96's P V as d128's,
    // S still exact, should the N = 96 read of V ever prove wrong on a GPU; the host's
    // accum_regs would then count 64 O registers).
    static constexpr int kOCols = kHeadDim;
    static constexpr int kKOffset = kQBytes;
    static constexpr int kVOffset = kKOffset + kStages * kKVBytes;
    // kTmaStore: O's staging tile, per consumer warpgroup kChunks chunks of 64 rows x 64 columns
    // (128-byte swizzled, as the O tensor map stores them); none without it
    static constexpr int kOStageChunkBytes = 64 * 128;
    static constexpr int kOStageWgBytes = kChunks * kOStageChunkBytes;
    static constexpr int kOStageOffset = kVOffset + kStages * kKVBytes;
    static constexpr int kOStageBytes = kTmaStore ? kConsumers * kOStageWgBytes : 0;
    // kPSmem: P_j's tile, per consumer warpgroup ceil(BN / 64) chunks of 64 rows x 64 keys
    // (128-byte swizzled, K-major: the A operand of the P V wgmma); none without it
    static constexpr int kPChunkBytes = 64 * 128;
    static constexpr int kPWgBytes = (kBN + 63) / 64 * kPChunkBytes;
    static constexpr int kPOffset = kOStageOffset + kOStageBytes;
    static constexpr int kPBytes = kPSmem ? kConsumers * kPWgBytes : 0;
    // kQDouble: Q's second buffer (odd tiles with keys) after the P tiles, and its full / empty
    // mbarriers after the tile ring; none without it
    static constexpr int kQ2Offset = kPOffset + kPBytes;
    static constexpr int kQ2Bytes = kQDouble ? kQBytes : 0;
    // kOnesRegion: the row sum's block of ones (ptx_sm90_rowsum.cuh; kFoldCap 3 / 4 without ALiBi)
    // before the mbarriers; none without it
    static constexpr int kOnesOffset = kQ2Offset + kQ2Bytes;
    static constexpr int kBarOffset = kOnesOffset + kOnesRegion;
    static constexpr int kBarriers = Sm90FwdBars<kStages>::kCount;   // Q full, Q empty; K/V full, K/V empty per slot
    // kDynamic: the tile ring after the barriers (Sm90TileRing: its 2 full and 2 empty mbarriers,
    // then its 2 tile indices)
    static constexpr int kRingOffset = kBarOffset + 8 * kBarriers;
    static constexpr int kRingBytes = kDynamic ? 8 * 4 + 4 * 2 : 0;
    static constexpr int kQ2BarOffset = kRingOffset + kRingBytes;
    static constexpr int kQ2BarBytes = kQDouble ? 2 * 8 : 0;
    // kDropEarly 4: the keep flags of one K/V block that the producer warpgroup's warps 1-3 draw
    // for the consumers (kGenBytes: 16 bytes per consumer thread and 32-key block, one part per
    // consumer warpgroup), 16-byte aligned, then a full and an empty mbarrier per part; none without it
    static constexpr int kGenOffset = (kQ2BarOffset + kQ2BarBytes + 15) / 16 * 16;
    static constexpr int kGenBarOffset = kGenOffset + kGenBytes;
    static constexpr int kGenAllBytes = kGenBytes ? kGenBarOffset + 16 * kConsumers - (kQ2BarOffset + kQ2BarBytes) : 0;
    // + 1024: the dynamic shared memory base is aligned up to 1024 bytes at run time
    static constexpr int kSmemBytes = kBarOffset + 8 * kBarriers + kRingBytes + kQ2BarBytes + kGenAllBytes + 1024;
    // Registers per thread after setmaxnreg (FA3's splits): the producer only issues TMA.
    // (kDropEarly 4, kGenBytes: the producer warpgroup's warps 1-3 run the Philox rounds: 40 with 2
    // consumers, which keep 232; 24 / 32 spilled the drawing loop, nvcc 13.0)
    static constexpr int kProducerRegs = kConsumers == 1 ? 56 : kConsumers == 2 ? (kGenBytes ? 40 : 24) : 32;
    static constexpr int kConsumerRegs = kConsumers == 1 ? 256 : kConsumers == 2 ? (kGenBytes ? 232 : 240) : 160;

    static_assert(kConsumers >= 1 && kConsumers <= 3, "consumers must be 1, 2 or 3");
    static_assert(kBM == 64 * kConsumers, "BM must be 64 * consumers: each consumer warpgroup owns 64 rows");
    static_assert(kBN % 16 == 0 && kBN >= 64 && kBN <= 192,
                  "BN must be a multiple of 16 in 64..192 (wgmma n, and P's k16 steps)");
    static_assert((kHeadDim % 64 == 0 || kHeadDim == 96) && kHeadDim <= 256,
                  "head dim must be 64, 96, 128, 192 or 256 (64-column swizzle chunks; d96: one and a half)");
    static_assert(kStages >= 2, "stages must be >= 2: the producer fills one slot while another is read");
    static_assert(kSmemBytes <= 227 * 1024, "shared memory exceeds the H100's 227 KB");
    static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536,
                  "the register split exceeds the register file");
};

// kDynamic's tile order (header: the dynamic scheduler). The (head, batch) pairs hb = head +
// nheads · batch are cut into sections of `section` consecutive pairs (the host sizes a section so
// that its K and V fit in L2; the last one may be shorter). Sections run one after the other;
// inside one, the Q block is the slow index, from the last (under a causal mask, the heaviest)
// to the first, and hb the fast one: the CTAs working at the same time take the same few Q blocks
// of every pair of the section, whose K/V stay in L2.
__device__ __forceinline__ Sm90Tile sm90_sectioned_tile(int tile, int m_blocks, int nheads, int n_hb,
                                                         int section) {
    const int per_section = section * m_blocks;
    const int first_hb = tile / per_section * section;
    const int in_section = tile % per_section;
    const int width = min(section, n_hb - first_hb);      // the last section may be shorter
    const int hb = first_hb + in_section % width;
    Sm90Tile at(0, 1, 1);
    at.m_block = m_blocks - 1 - in_section / width;
    at.head = hb % nheads;
    at.batch = hb / nheads;
    return at;
}

// kDynamic: the producer thread claims tiles from a global counter and hands each to the consumer
// warpgroups through a ring of 2 shared-memory slots (header: the dynamic scheduler). A CTA's
// first tile is blockIdx.x without a claim; every further tile is gridDim.x + atomicAdd(counter,
// 1). The n-th handed-over tile (n = 0 is the CTA's second one) goes to slot n % 2: `full` (one
// arrival: the producer's, after writing the index; mbarrier.arrive releases the write, the
// consumers' wait acquires it) and `empty` (kConsumers · 128 arrivals: every consumer thread, once
// it has read the index). A claimed index >= n_tiles ends the CTA's loop, on both sides.
// The counter's reset: each CTA claims until it draws an index past the tiles, so a launch makes
// exactly n_tiles claims (n_tiles - gridDim.x that succeed, one that fails per CTA; the host
// launches at most n_tiles CTAs) and draws 0..n_tiles - 1: the CTA that draws n_tiles - 1 made
// the launch's last claim and sets the counter back to 0 for the next launch (zeroed once when
// allocated, never read by the host: CUDA graphs replay it as is).
template <int kConsumers>
struct Sm90TileRing {
    u32 bars;          // full[2], empty[2]
    int* tiles;        // the 2 slots' tile indices (shared memory)
    int n = 0;         // tiles handed over (producer) or taken (consumers) so far
    __device__ __forceinline__ u32 full(int slot) const { return bars + 8u * slot; }
    __device__ __forceinline__ u32 empty(int slot) const { return bars + 8u * (2 + slot); }
    __device__ __forceinline__ void init() const {
        for (int s = 0; s < 2; ++s) {
            mbarrier_init(full(s), 1);
            mbarrier_init(empty(s), kConsumers * 128);
        }
    }
    // producer: claim the next tile and hand it over
    __device__ __forceinline__ int claim(int* counter, int n_tiles) {
        const int drawn = atomicAdd(counter, 1);
        if (drawn == n_tiles - 1) atomicExch(counter, 0);   // the launch's last claim
        const int tile = int(gridDim.x) + drawn;
        const int slot = n & 1;
        if (n >= 2) mbarrier_wait(empty(slot), u32((n >> 1) - 1) & 1);
        reinterpret_cast<volatile int*>(tiles)[slot] = tile;
        mbarrier_arrive(full(slot));
        ++n;
        return tile;
    }
    // consumers: the next tile the producer handed over
    __device__ __forceinline__ int take() {
        const int slot = n & 1;
        mbarrier_wait(full(slot), u32(n >> 1) & 1);
        const int tile = reinterpret_cast<volatile int*>(tiles)[slot];
        mbarrier_arrive(empty(slot));
        ++n;
        return tile;
    }
};

// kSAhead: one tile's K/V loop with S_{j+1} = Q K_{j+1}ᵀ issued before the softmax of
// S_j, into a second accumulator (s_next), so that the softmax never waits for its own S GEMM: S_j
// was issued a whole step earlier and has landed by the turn that takes it. Step j (j >= 1):
//   turn: S_j (landed) moved into s_acc (take_s_ahead), O += P_{j-1} V_{j-1}, then S_{j+1} into
//         s_next (j + 1 < n)
//   softmax_s(j) under both GEMMs; wait for both (wgmma_wait<0>: with the wait for P V alone on one
//   path and for both on the other, ptxas (nvcc 13.0) serialized every wgmma, C7514), release
//   V_{j-1}, rescale O, P_j to the A operand
// j = 0 issues S_0 and S_1 in one turn and takes S_0 straight in s_acc. The end: O += P_{n-1} V_{n-1}.
// The parts are sm90_consume_blocks' (sm90_fwd_common.cuh) and issue_s_ahead(slot) (S into s_next),
// take_s_ahead() (s_next -> s_acc, once landed). Registers: s_acc, s_next, O and P_{j-1} live together.
template <int kStages, bool kPair, class Turn, int kS, int kSN, int kO, class IssueS, class IssueSAhead,
          class TakeSAhead, class IssuePv, class SoftmaxS, class ToP, class RescaleO>
__device__ __forceinline__ void sm90_consume_blocks_ahead(
        const Sm90FwdBars<kStages, kPair>& bar, const Turn& turn, int kv_iter, int n_blocks, bool last_tile,
        float (&s_flat)[kS], float (&s_next)[kSN], float (&o_flat)[kO], IssueS&& issue_s, IssueSAhead&& issue_s_ahead,
        TakeSAhead&& take_s_ahead, IssuePv&& issue_pv, SoftmaxS&& softmax_s, ToP&& to_p, RescaleO&& rescale_o) {
    auto phase = [&](int j) { return u32((kv_iter + j) / kStages) & 1; };
    auto slot_of = [&](int j) { return (kv_iter + j) % kStages; };
    // j = 0: S_0 (and S_1 behind it), softmax -> P_0; O is still zero
    turn.begin();
    mbarrier_wait(bar.k_full(slot_of(0)), phase(0));
    reg_fence(s_flat);
    reg_fence(s_next);
    reg_fence(o_flat);
    wgmma_fence();
    issue_s(slot_of(0));
    if (n_blocks > 1) {
        mbarrier_wait(bar.k_full(slot_of(1)), phase(1));
        issue_s_ahead(slot_of(1));
    }
    turn.end();
    wgmma_wait<0>();                       // S_0 (and S_1) have landed
    softmax_s(slot_of(0), 0);
    to_p(0);
    for (int j = 1; j < n_blocks; ++j) {
        const int slot = slot_of(j), prev = slot_of(j - 1);
        turn.begin();
        wgmma_wait<0>();                   // (j = 1: S_1; later steps waited for theirs already)
        take_s_ahead();                    // S_j -> s_acc
        mbarrier_wait(bar.v_full(prev), phase(j - 1));
        reg_fence(s_flat);
        reg_fence(s_next);
        reg_fence(o_flat);
        wgmma_fence();
        issue_pv(prev);                    // O += P_{j-1} V_{j-1}
        const bool ahead = j + 1 < n_blocks;
        if (ahead) {
            mbarrier_wait(bar.k_full(slot_of(j + 1)), phase(j + 1));
            issue_s_ahead(slot_of(j + 1)); // S_{j+1} -> s_next
        }
        turn.end();
        softmax_s(slot, j);                // under P_{j-1} V_{j-1} and S_{j+1}
        wgmma_wait<0>();                   // P_{j-1} V_{j-1} is in O, S_{j+1} in s_next
        reg_fence(o_flat);
        bar.release(bar.v_empty(prev), kv_iter + j - 1);
        rescale_o();
        to_p(j);
    }
    // end: the last block's O += P V (the tile's final turn)
    const int last = slot_of(n_blocks - 1);
    turn.begin();
    mbarrier_wait(bar.v_full(last), phase(n_blocks - 1));
    reg_fence(o_flat);
    wgmma_fence();
    issue_pv(last);
    turn.end(last_tile);
    wgmma_wait<0>();
    reg_fence(o_flat);
    bar.release(bar.v_empty(last), kv_iter + n_blocks - 1);
}

// The kernel's body (sm90_fwd, and sm90_fwd_cluster for kCluster, below, are its entry points; p is
// the entry point's __grid_constant__ parameter).
template <int kBM, int kBN, int kStages, int kConsumers, bool kPingpong, bool kPersistent, int kHeadDim,
          class Elem, bool kCausal, bool kWindow, bool kSoftcap, bool kAlibi, bool kDropout, int kEmuExp2,
          bool kDynamic, bool kTmaStore, bool kVarlen, bool kPSmem, bool kTreeMax, bool kQDouble,
          bool kLazyRescale, int kFoldCap, bool kAlibiLinear, bool kRescaleFirst, bool kTileOverlap,
          bool kDropPacked, int kDropEarly, bool kStreamTail, bool kPvOverlap, bool kCluster, int kMaskedCopy,
          int kRagKeys, bool kPrefetch, bool kSAhead, bool kDeferMax>
__device__ __forceinline__ void sm90_fwd_body(const Sm90FwdParams& p) {
    // kDropEarly 4: one K/V block's keep flags, 16 bytes per consumer thread and 32-key block
    static constexpr int kGenBytes = kDropEarly == 4 ? kConsumers * 128 * (kBN / 32) * 16 : 0;
    // kFoldCap 3, 4 with the fixed max (kRoundedL): O's normalizer is the running row sum of P as
    // rounded for the P V GEMM (l keeps the LSE's; softmax_fold.cuh RoundedSum's note), summed by
    // the tensor cores beside O (kRowSumMma: ptx_sm90_rowsum.cuh, its block of ones in shared
    // memory) or, kRowSumMma false, on the CUDA cores in the softmax step (add_rounded). Not with
    // ALiBi: its scores take the row-max step (softmax_s), which sums l only
    constexpr bool kRoundedL = kFoldCap >= 3 && !kAlibi;
    constexpr bool kRowSumMma = kRoundedL;
    using Shape = Sm90FwdShape<kBM, kBN, kStages, kConsumers, kHeadDim, kDynamic, kTmaStore, kPSmem, kQDouble,
                               kGenBytes, kRoundedL ? kOnesBytes : 0>;
    using Mask = BandMask<kCausal, kWindow>;
    constexpr int kChunks = Shape::kChunks;
    // the producer's tiles: Q_i, K_j and V_j as kChunks boxes of 64 columns (d96: the second one
    // half zeros, header)
    using QTile = Sm90RowTile<kChunks, 64, Shape::kQChunkBytes>;
    // (kCluster: each CTA of the cluster loads half of K_j's and V_j's chunks into both, sm90_fwd_common.cuh)
    using KVTile = Sm90RowTile<kChunks, 64, Shape::kKVChunkBytes, kCluster>;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const u32 q_smem = smem;
    const u32 k_smem = smem + Shape::kKOffset;
    const u32 v_smem = smem + Shape::kVOffset;
    // kCluster: the CTA's K/V iterations (its static persistent tiles, every one with all ceil(seqlen_k / BN)
    // blocks: non-causal, fixed lengths), after which no remote release is sent (Sm90FwdBars)
    auto pair_kv_total = [&]() {
        const int n_tiles = (p.seqlen_q + kBM - 1) / kBM * p.nheads * p.batch;
        return (n_tiles - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x) * ((p.seqlen_k + kBN - 1) / kBN);
    };
    // Q's and the K/V ring's (sm90_fwd_common.cuh)
    const Sm90FwdBars<kStages, kCluster> bar{smem + Shape::kBarOffset, kCluster ? pair_kv_total() : 0};
    // kQDouble: Q's buffer b (0: q_smem, 1: the second one) and its mbarriers. The n-th tile with
    // keys uses buffer n % 2, whose fills are numbered n / 2 (phases as Q's: header). Without it
    // every tile uses buffer 0, bar.q_full() / bar.q_empty(), and the code is the single buffer's.
    auto q_buf = [&](int b) { return kQDouble && b ? smem + Shape::kQ2Offset : q_smem; };
    const u32 q_full = bar.q_full(), q_empty = bar.q_empty();
    auto q_full_of = [&](int b) { return kQDouble && b ? smem + Shape::kQ2BarOffset : q_full; };
    auto q_empty_of = [&](int b) { return kQDouble && b ? smem + Shape::kQ2BarOffset + 8u : q_empty; };
    auto q_slot = [&](int q_iter) { return kQDouble ? q_iter & 1 : 0; };       // buffer of tile q_iter
    auto q_fill = [&](int q_iter) { return kQDouble ? q_iter >> 1 : q_iter; }; // its fill number
    static_assert(!kPingpong || kConsumers >= 2, "pingpong needs two or three consumer warpgroups");
    static_assert(!kCluster || (kPersistent && !kDynamic && !kVarlen && !kCausal && !kWindow && !kStreamTail
                                && !kTileOverlap && !kQDouble && !kSoftcap && !kAlibi && !kDropout && kChunks % 2 == 0),
                  "kCluster: the static persistent plain non-causal kernel (both CTAs of a cluster walk adjacent "
                  "Q blocks of the same heads, with the same K/V blocks), an even number of column chunks");
    static_assert(!kDynamic || kPersistent, "the dynamic scheduler runs a persistent grid (a CTA per SM)");
    static_assert(!kTileOverlap || (kPersistent && !kVarlen && !kPSmem && !kRescaleFirst && !kSoftcap && !kAlibi
                                    && !kDropout && kEmuExp2 == 0 && !kLazyRescale && kFoldCap == 0),
                  "kTileOverlap: the persistent kernel without softmax variants (every tile has keys: the host "
                  "checks it, sm90_fwd.py tile_overlap_fits)");
    static_assert(!kTileOverlap || ((!kCausal && !kDynamic && !kTmaStore && !kQDouble) || kWindow),
                  "kTileOverlap with a causal mask, the dynamic scheduler, the TMA-store epilogue or two Q "
                  "buffers: windowed calls only (the plain kernel's form is the static non-causal one)");
    // kVarlen skips tiles past a sequence's end, which the dynamic scheduler's pingpong count does
    // not allow for; and a TMA store of O would write a box's rows past the sequence's end, into
    // the next sequence's rows (TMA clips only at the packed tensor's end)
    static_assert(!kVarlen || (!kDynamic && !kTmaStore), "varlen runs without kDynamic and kTmaStore");
    static_assert(kFoldCap >= 0 && kFoldCap <= 4 && (!kFoldCap || kSoftcap),
                  "kFoldCap (0..4) folds the softcap: it needs kSoftcap");
    static_assert(kFoldCap != 4 || Exp2PolyDegree<Elem>::value == 3,
                  "kFoldCap 4 prescales Q in bf16 (Exp2PolyDegree's 3 marks bf16): fp16 products underflow");
    static_assert(kFoldCap < 2 || kLazyRescale, "kFoldCap 2, 3, 4 run with kLazyRescale");
    static_assert(kMaskedCopy >= 0 && kMaskedCopy <= 2 && (kMaskedCopy == 0 || (kFoldCap >= 3 && !kAlibi)),
                  "kMaskedCopy (0..2) copies the folded softcap step (kFoldCap >= 3, no kAlibi)");
    static_assert(kRagKeys == 0 || (kRagKeys % 16 == 0 && kRagKeys > 0 && kRagKeys < kBN && !kCausal && !kWindow
                                    && !kSoftcap && !kAlibi && !kDropout && !kVarlen && !kTileOverlap && !kStreamTail
                                    && !kCluster && !kPvOverlap && !kPSmem && !kRowSumMma),
                  "kRagKeys: a multiple of 16 below kBN, plain non-causal fixed-length calls without tile_overlap, "
                  "stream_tail, cluster, pv_overlap or p_smem");
    static_assert(!kPrefetch || (kPersistent && !kDynamic && !kStreamTail && !kCluster && !kVarlen),
                  "kPrefetch: the static persistent schedule (the next tile is tile + gridDim.x), fixed lengths");
    static_assert(!kSAhead || (kFoldCap >= 3 && !kAlibi && !kDropout && !kTileOverlap && !kPvOverlap && !kPSmem
                               && !kRescaleFirst && !kStreamTail && !kCluster),
                  "kSAhead runs the folded softcap step (kFoldCap >= 3) alone: no ALiBi, dropout, tile_overlap, "
                  "pv_overlap, P in shared memory, rescale_first, stream_tail or cluster");
    static_assert(!kDeferMax || (kFoldCap >= 3 && !kAlibi && kLazyRescale && !kDropout && !kStreamTail),
                  "kDeferMax defers the folded softcap row max (kFoldCap >= 3, kLazyRescale; O normalized by the "
                  "tensor cores' row sum): no ALiBi, dropout or stream_tail");
    static_assert(!(kLazyRescale || kFoldCap) || ((kEmuExp2 == 0 || kFoldCap != 0) && !kDropout),
                  "kLazyRescale / kFoldCap run no dropout, and the software exp2 only with kFoldCap (softmax_fold.cuh)");
    static_assert(!kDropPacked || (kDropout && !kPSmem),
                  "kDropPacked applies dropout to P's A fragments in registers: it needs kDropout, not kPSmem");
    static_assert(kDropEarly >= 0 && kDropEarly <= 6 && (!kDropEarly || kDropPacked),
                  "kDropEarly (0..6) applies its keep flags to P's packed fragments: it needs kDropPacked");
    static_assert(kDropEarly != 4 || (!kDynamic && !kVarlen),
                  "kDropEarly 4: the drawing warps walk the static tile order (no kDynamic, no kVarlen)");
    // kDropEarly 4: the drawn flags, warpgroup w's part, and its mbarriers (full: the 96 drawing
    // threads have stored it; empty: the warpgroup's 128 threads have copied their flags)
    constexpr int kGenPartBytes = 128 * (kBN / 32) * 16;
    auto gen_part = [&](int w) { return smem + Shape::kGenOffset + u32(w * kGenPartBytes); };
    auto gen_full = [&](int w) { return smem + Shape::kGenBarOffset + 16u * w; };
    auto gen_empty = [&](int w) { return smem + Shape::kGenBarOffset + 16u * w + 8u; };
    static_assert(!kRescaleFirst || !(kLazyRescale || kFoldCap),
                  "kRescaleFirst rescales O every step: not with kLazyRescale / kFoldCap");
    static_assert(!kAlibiLinear || (kAlibi && !kSoftcap && !kDropout && kEmuExp2 == 0 && !kVarlen && !kTreeMax),
                  "kAlibiLinear is ALiBi's bias alone (no softcap, dropout, emu_exp2, varlen, tree_max)");
    static_assert(!kStreamTail || (kPersistent && !kDynamic && !kVarlen && !kTileOverlap && !kCausal && !kWindow
                                   && !kSoftcap && !kAlibi && !kDropout && kEmuExp2 == 0 && !kLazyRescale
                                   && kFoldCap == 0),
                  "kStreamTail: the static persistent plain non-causal kernel (every tile has the same "
                  "K/V blocks; sm90_tail.cuh)");
    Sm90TileRing<kConsumers> ring{smem + Shape::kRingOffset,
                                  reinterpret_cast<int*>(smem_raw + (smem - smem_u32(smem_raw)) +
                                                         Shape::kRingOffset + 32)};

    const int tid = threadIdx.x, warpgroup = tid / 128;
    const int m_blocks = (p.seqlen_q + kBM - 1) / kBM;
    const int n_tiles = m_blocks * p.nheads * p.batch;
    // tile -> (Q block, head, batch): the plain order (Sm90Tile), or kDynamic's sections
    auto tile_at = [&](int tile) {
        if constexpr (kDynamic)
            return sm90_sectioned_tile(tile, m_blocks, p.nheads, p.nheads * p.batch, p.sched_section);
        else
            return Sm90Tile(tile, m_blocks, p.nheads);
    };
    // K/V blocks [kv_end - kv_blocks, kv_end) of a Q block, visited from the last to the
    // first (causal: later blocks are skipped entirely; a window skips earlier ones too).
    const Mask mask(p.seqlen_q, p.seqlen_k, p.window_left, p.window_right);
    // kVarlen: the tile's sequence (varlen.cuh: its first rows in the packed tensors, its lengths)
    // and the mask built from its lengths. Fixed lengths use `mask` and the params' sizes (the
    // code of the plain kernel is unchanged by kVarlen: every varlen expression sits in a
    // compile-time branch).
    auto seq_of = [&](int tile) { return seq_span<kVarlen>(p, tile_at(tile).batch); };
    auto seq_mask = [&](const SeqSpan& seq) {
        return Mask(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
    };
    // a tile past its sequence's end (the grid is sized for the longest one): no K/V block
    auto past_end = [&](int tile, const SeqSpan& seq) {
        return tile_at(tile).m_block * kBM >= seq.seqlen_q;
    };
    auto kv_end = [&](int tile) {
        if constexpr (kVarlen) {
            return seq_mask(seq_of(tile)).template kv_block_end<kBM, kBN>(
                tile_at(tile).m_block * kBM);
        } else {
            return mask.template kv_block_end<kBM, kBN>(tile_at(tile).m_block * kBM);
        }
    };
    auto kv_blocks = [&](int tile) {
        const int row0 = tile_at(tile).m_block * kBM;
        if constexpr (kVarlen) {
            const SeqSpan seq = seq_of(tile);
            if (past_end(tile, seq)) return 0;
            const Mask tile_mask = seq_mask(seq);
            return max(0, tile_mask.template kv_block_end<kBM, kBN>(row0)
                              - tile_mask.template kv_block_begin<kBM, kBN>(row0));
        } else {
            return max(0, mask.template kv_block_end<kBM, kBN>(row0) - mask.template kv_block_begin<kBM, kBN>(row0));
        }
    };
    // kStreamTail: the CTA's pieces (sm90_tail.cuh), the same on the producer's and the consumers' side
    Sm90TailSchedule sched(n_tiles, p.tail_n, p.tail_dp_end, p.tail_q, p.tail_rem, p.tail_magic, p.tail_shift);
    auto first_tile = [&]() { return kStreamTail ? sched.first() : int(blockIdx.x); };
    // a piece's loop blocks: n_end and n_blocks of its tile narrowed to [jb, je) (the loop's block
    // j is the tile's jb + j, block index n_end - 1 - j)
    auto narrow = [&](int& n_blocks, int& n_end) {
        if constexpr (kStreamTail) {
            n_end -= sched.jb;
            n_blocks = sched.je - sched.jb;
        }
    };

    if (tid == 0) {
        prefetch_tensormap(&p.tma_q);
        prefetch_tensormap(&p.tma_k);
        prefetch_tensormap(&p.tma_v);
        if constexpr (kTmaStore) prefetch_tensormap(&p.tma_o);
        bar.init_q(kConsumers * 128);
        if constexpr (kQDouble) {
            mbarrier_init(q_full_of(1), 1);
            mbarrier_init(q_empty_of(1), kConsumers * 128);
        }
        // (kCluster: the partner's releases too, one per consumer warp)
        bar.init_ring(kConsumers * 128 + bar.remote_arrivals(kConsumers * 128));
        if constexpr (kDynamic) ring.init();
        if constexpr (kDropEarly == 4)
            for (int w = 0; w < kConsumers; ++w) {
                mbarrier_init(gen_full(w), 96);             // the producer warpgroup's warps 1-3
                mbarrier_init(gen_empty(w), 128);           // the warpgroup's threads
            }
        if constexpr (kRowSumMma) {
            // the row sum's block of ones, then visible to the wgmmas (async proxy)
            const u32 one2[4] = {ones_pair<Elem>(), ones_pair<Elem>(), ones_pair<Elem>(), ones_pair<Elem>()};
            for (int i = 0; i < kOnesBytes / 16; ++i) st_shared_v4(smem + Shape::kOnesOffset + 16 * i, one2);
            fence_proxy_async_smem();
        }
        fence_mbarrier_init();                              // visible to TMA's complete_tx
    }
    __syncthreads();                                        // and to every thread
    if constexpr (kCluster) cluster_sync();     // both CTAs' barriers initialised before any multicast

    if (warpgroup == 0) {
        // ---- producer: one thread issues every TMA copy ----
        setmaxnreg_dec<Shape::kProducerRegs>();
        if constexpr (kDropEarly == 4) {
            if (tid >= 32) {
                // ---- kDropEarly 4: warps 1-3 draw every consumer thread's keep flags of each K/V
                // block, in the consumers' order (tiles, then blocks from the last), warpgroup by
                // warpgroup, each part one block ahead of its warpgroup at most: the Philox rounds
                // leave the consumers' warps ----
                const int gt = tid - 32;                    // 0..95
                const Dropout dropout = Dropout::load(p.rng_state, p.dropout_threshold, p.dropout_scale);
                const KeepSwar swar = KeepSwar::make(dropout.threshold);
                constexpr int kCalls = 128 * (kBN / 32);    // per K/V block and consumer warpgroup
                int gen_iter = 0;
                for (int tile = blockIdx.x; tile < n_tiles; tile += grid_dim_x_volatile()) {
                    const Sm90Tile at = tile_at(tile);
                    const int n_blocks = kv_blocks(tile), n_end = kv_end(tile);
                    const int bh = at.batch * p.nheads + at.head;
                    for (int j = 0; j < n_blocks; ++j, ++gen_iter) {
                        const int key0 = (n_end - 1 - j) * kBN;
                        for (int w = 0; w < kConsumers; ++w) {
                            // the part's last block copied by every thread of the warpgroup
                            if (gen_iter > 0) mbarrier_wait(gen_empty(w), (gen_iter - 1) & 1);
#pragma unroll 1
                            for (int c = gt; c < kCalls; c += 96) {
                                // call c: 32-key block blk of the warpgroup's thread ct (rows g, g + 8
                                // of its warp's 16, columns 2t, 2t + 1 of each 8: Dropout::zero_dropped's)
                                const int blk = c / 128, ct = c % 128, lane_c = ct % 32;
                                const int row = at.m_block * kBM + w * 64 + (ct / 32) * 16 + lane_c / 4;
                                const PhiloxWords pw = dropout.draw(bh, row, key0 + 32 * blk + 2 * (lane_c % 4));
                                const u32 flags[4] = {swar.signs(pw.w[0]), swar.signs(pw.w[1]),
                                                      swar.signs(pw.w[2]), swar.signs(pw.w[3])};
                                st_shared_v4(gen_part(w) + c * 16, flags);
                            }
                            mbarrier_arrive(gen_full(w));   // (release: the stores above are visible)
                        }
                    }
                }
                return;
            }
        }
        if (tid == 0) {
            int kv_iter = 0, q_iter = 0;   // the CTA's K/V iterations and tiles with keys so far
            // next tile: the static stride, or kDynamic's claim (handed to the consumers)
            auto next_tile = [&](int tile) {
                if constexpr (kDynamic) return ring.claim(p.tile_counter, n_tiles);
                else if constexpr (kStreamTail) return sched.next(tile);
                else return tile + int(gridDim.x);
            };
            for (int tile = first_tile(); tile < n_tiles; tile = next_tile(tile)) {
                const Sm90Tile at = tile_at(tile);
                const int head_kv = at.head / (p.nheads / p.nheads_kv);   // GQA / MQA
                int n_blocks = kv_blocks(tile), n_end = kv_end(tile);
                narrow(n_blocks, n_end);
                if (n_blocks == 0) continue;                 // nothing to load: O = 0
                // TMA box rows and batch coordinate: kVarlen, the sequence's first row in the
                // packed tensor (batch extent 1); fixed lengths, row 0 of batch at.batch
                const SeqSpan seq = seq_of(tile);
                const int q_row0 = seq.q_start + at.m_block * kBM, k_row0 = seq.k_start;
                const int tma_batch = kVarlen ? 0 : at.batch;
                // Q's buffer is free once the consumers' last S GEMM of its previous tile is done
                // (kQDouble: the tile before the previous one, long done: the load runs ahead)
                const int qb = q_slot(q_iter);
                sm90_load_q<QTile>(q_buf(qb), q_full_of(qb), q_empty_of(qb), q_fill(q_iter), &p.tma_q, q_row0, at.head,
                                   tma_batch);
                ++q_iter;
                if constexpr (kPrefetch) {
                    // the CTA's next tile's Q into L2 (header: kPrefetch)
                    const int next = tile + int(gridDim.x);
                    if (next < n_tiles) {
                        const Sm90Tile nt = tile_at(next);
#pragma unroll
                        for (int b = 0; b < kChunks; ++b)
                            tma_prefetch_4d(&p.tma_q, b * 64, nt.m_block * kBM, nt.head, nt.batch);
                    }
                }
                // the tile's K/V blocks from the last (block j: keys k_row0 + (n_end - 1 - j) · kBN on),
                // into the ring (sm90_fwd_common.cuh: slot reuse)
                auto key0 = [&](int j) { return k_row0 + (n_end - 1 - j) * kBN; };
                sm90_fill_kv<KVTile, KVTile>(bar, kv_iter, n_blocks, key0, k_smem, v_smem, &p.tma_k, &p.tma_v, head_kv,
                                             tma_batch);
            }
        }
        return;
    }

    // ---- consumers ----
    setmaxnreg_inc<Shape::kConsumerRegs>();
    const int wg = warpgroup - 1;                           // consumer index: rows 64·wg..64·wg+63
    const int warp = (tid / 32) % 4, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;                   // accumulator fragment coordinates

    // Descriptors of this warpgroup's 64 rows of Q_i (K-major) and of slot 0's K_j (K-major)
    // and V_j (MN-major: the head dim, wgmma's N, is contiguous).
    const u64 q_desc = smem_desc_sw128(q_smem + wg * 64 * 128, 16, 1024);
    u32 q_buf_shift = 0;   // kQDouble: the tile's Q buffer, as descriptor address units past q_smem
    const u64 k_desc = smem_desc_sw128(k_smem, 16, 1024);
    const u64 v_desc = smem_desc_sw128(v_smem, Shape::kKVChunkBytes, 1024);
    // kPSmem: this warpgroup's P tile (K-major like Q)
    const u32 p_smem = smem + Shape::kPOffset + wg * Shape::kPWgBytes;
    const u64 p_desc = smem_desc_sw128(p_smem, 16, 1024);
    const Pingpong<kPingpong, kConsumers> turn(wg);

    // O: 64 x kOCols (the head dim) per warpgroup, 16 rows per warp, fp32. Thread (g, t) of a
    // warp holds rows warp_row0 + g + 8·half; [0][nt][2·half + e] is column 8·nt + 2t + e (per
    // warp the wgmma accumulator layout is mma.sync's, so softmax.cuh and mask.cuh apply
    // unchanged).
    constexpr int kOCols = Shape::kOCols;
    float o_acc[1][kOCols / 8][4];
    float m[1][2];  // running row max of the raw scores S (not yet scaled)
    float l[1][2];  // running row sum of P, this thread's columns only
    // kRoundedL (above): the running row sum of P as rounded for the P V GEMM, O's normalizer.
    // kRowSumMma: lr_acc, the m64n8 wgmma's accumulator (every column the row's sum: element
    // 2·half + e is row g + 8·half); else lr, this thread's columns (quad-summed at the end)
    float lr[1][2];
    float lr_acc[4];
    const u64 ones_desc = smem_desc_ones(smem + Shape::kOnesOffset);
    // (uniform per launch; kDeferMax: always, O and Σ P̃ miss the last deferred factor alike, l has it)
    auto rounded_l = [&]() { return kRoundedL && (kDeferMax || p.softcap_fixed_m <= 1.f); };
    auto lr_row = [&](int half) { return kRowSumMma ? lr_acc[2 * half] : quad_sum(lr[0][half]); };
    float (&o_flat)[kOCols / 2] = reinterpret_cast<float (&)[kOCols / 2]>(o_acc);
    float s_acc[1][kBN / 8][4];                            // S_j (64 x BN), then P_j (fp32)
    float (&s_flat)[kBN / 2] = reinterpret_cast<float (&)[kBN / 2]>(s_acc);
    // kSAhead: S_{j+1}, issued before the softmax of S_j (moved into s_acc once it has landed)
    float s_next[kSAhead ? kBN / 2 : 1];
    u32 p_frag[1][kBN / 16][4];                            // P_{j-1} as 16-bit A fragments
    float alpha[1][2];                                     // O's rescale for block j, per row
    Dropout dropout{};                                     // kDropout: this launch's keep mask and scale
    if constexpr (kDropout)
        dropout = Dropout::load(p.rng_state, p.dropout_threshold, p.dropout_scale);
    KeepSwar swar{};                                       // kDropEarly: the keep test on 4 bytes at once
    if constexpr (kDropEarly) swar = KeepSwar::make(dropout.threshold);

    // S_j = Q_i K_jᵀ (64 x BN per warpgroup, fp32): issued, not waited for. kHeadDim / 16 steps:
    // d96 stops after chunk 1's second step, before its zero columns.
    // kRagKeys: the tile's first P V (its ragged last K/V block's) still to issue at kRagKeys / 16 steps
    bool rag_pv = false;
    // (kSAhead: into s_next, issue_s_ahead)
    auto issue_s_into = [&](float (&acc)[kBN / 2], int slot) {
        const u64 slot_off = u64(slot * Shape::kKVBytes) >> 4;  // descriptor address units
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            // k16 step kk: column chunk kk / 4, 32 bytes per step inside the chunk
            const u64 q_off = u64((kk / 4) * Shape::kQChunkBytes + (kk % 4) * 32) >> 4;
            const u64 k_off = u64((kk / 4) * Shape::kKVChunkBytes + (kk % 4) * 32) >> 4;
            Wgmma<kBN, Elem>::template ss<0>(acc, q_desc + (kQDouble ? q_buf_shift + q_off : q_off),
                                             k_desc + slot_off + k_off, kk > 0);
        }
        wgmma_commit();
    };
    auto issue_s = [&](int slot) { issue_s_into(s_flat, slot); };
    // O += P_{j-1} V_{j-1}: issued, not waited for (keys 16kk..16kk+15: 16 rows of 128 B). One
    // wgmma with N = kOCols per k16 step; d96's reads chunk 0 and half of chunk 1 (header).
    // kPSmem: A = P_{j-1} from this warpgroup's P tile in shared memory (wgmma SS; K-major like
    // Q: chunk kk / 4, 32 bytes per step inside it), so no register holds P.
    auto issue_pv = [&](int slot) {
        const u64 slot_off = u64(slot * Shape::kKVBytes) >> 4;
        if constexpr (kRagKeys > 0) {
            if (rag_pv) {   // the ragged block: P is 0 past its kRagKeys keys
                rag_pv = false;
#pragma unroll
                for (int kk = 0; kk < kRagKeys / 16; ++kk)
                    Wgmma<kOCols, Elem>::template rs<1>(o_flat, p_frag[0][kk], v_desc + slot_off + (u64(kk * 16 * 128) >> 4),
                                                        1);
                wgmma_commit();
                return;
            }
        }
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) {
            const u64 v_off = slot_off + (u64(kk * 16 * 128) >> 4);
            if constexpr (kPSmem)
                Wgmma<kOCols, Elem>::template ss<1>(
                    o_flat, p_desc + (u64((kk / 4) * Shape::kPChunkBytes + (kk % 4) * 32) >> 4), v_desc + v_off, 1);
            else
                Wgmma<kOCols, Elem>::template rs<1>(o_flat, p_frag[0][kk], v_desc + v_off, 1);
            if constexpr (kRowSumMma)   // Σ P̃ += P_{j-1}'s k16 step times ones (ptx_sm90_rowsum.cuh)
                Wgmma<8, Elem>::template rs<0>(lr_acc, p_frag[0][kk], ones_desc, 1);
        }
        wgmma_commit();
    };
    // P_j (s_acc, fp32) to the 16-bit A operand of the next O += P V: fragments in registers, or
    // (kPSmem) this warpgroup's P tile. There each k16 step is one stmatrix of the A fragment's
    // four 8 x 8 matrices (rows r and r + 8 of the warp's 16, keys 16kk..16kk+7 and +8..+15), lane
    // l addressing row l % 8 of matrix l / 8, 128-byte swizzled (16-byte unit u of row r at
    // u ^ (r % 8): a matrix's 8 rows hit 8 distinct bank groups). A warp writes only its own 16 rows,
    // which only its own part of the wgmma reads (FA3's reasoning too), so a fence to the async
    // proxy and a warp barrier order the stores before the wgmma; the previous P V (the tile's
    // only other reader) has completed before softmax_rescale, hence before this runs.
    auto pack_p = [&]() {
        if constexpr (kPSmem) {
            // lane l: row r = l % 8 (+ 8 for matrices 1, 3) and 8-key tile nt = 2kk + l / 16 of the
            // warp's; that tile's unit nt % 8 = (2kk % 8) | (l / 16), so the swizzled unit is
            // (l / 16 ^ r) ^ (2kk % 8), and the row's base has 7 zero bits: one lane-constant
            // address, XORed with a step constant and offset by the step's chunk
            const int mat = lane / 8, r = lane % 8;
            const u32 lane_addr = p_smem + (warp * 16 + r + 8 * (mat & 1)) * 128 + (((mat >> 1) ^ r) * 16);
#pragma unroll
            for (int kk = 0; kk < kBN / 16; ++kk) {
                const u32 frag[4] = {pack2<Elem>(s_acc[0][2 * kk][0], s_acc[0][2 * kk][1]),
                                     pack2<Elem>(s_acc[0][2 * kk][2], s_acc[0][2 * kk][3]),
                                     pack2<Elem>(s_acc[0][2 * kk + 1][0], s_acc[0][2 * kk + 1][1]),
                                     pack2<Elem>(s_acc[0][2 * kk + 1][2], s_acc[0][2 * kk + 1][3])};
                stmatrix_x4((lane_addr ^ u32((2 * kk % 8) * 16)) + (kk / 4) * Shape::kPChunkBytes, frag);
            }
            fence_proxy_async_smem();
            __syncwarp();
        } else {
            pack_a_frags<1, kBN / 16, Elem>(p_frag, s_acc);
        }
    };

    // The epilogues' factors, read where a row is stored. O's: 1 / l (kRoundedL: 1 / Σ P̃, so that O
    // is a convex combination of V's rows; the LSE still from l), kDropout times 1 / (1 - p): O =
    // (P ∘ Z) V / (l (1 - p)). The LSE's scale: softmax_scale (kFoldCap: times softcap_out, S being
    // kept as t = tanh(S·softcap_in)).
    // (kRoundedL: O / Σ P̃, a convex combination of V's rows; the LSE from l)
    auto o_factor = [&](int half, float l_row) {
        float inv_l = softmax_inv_l(rounded_l() ? lr_row(half) : l_row);
        if constexpr (kDropout) inv_l *= dropout.scale;
        return inv_l;
    };
    auto lse_scale = [&]() { return kFoldCap ? p.softmax_scale * p.softcap_out : p.softmax_scale; };

    // kTmaStore's epilogue: O = acc / l written into this warpgroup's staging tile (128-byte
    // swizzle: 16-byte unit u of row r at u ^ (r % 8); a warp's 32 four-byte stores of one column
    // step hit 32 different banks), then one thread stores the tile by TMA (rows past seqlen_q
    // and columns past head_dim are clipped by the tensor map) and the warpgroup goes on to its
    // next tile. Before rewriting the tile, that thread waits until the previous store has read
    // it (bulk_wait_group_read), and the warpgroup's named barrier (4 + wg: pingpong has 1..3)
    // holds the others until then. LSE from registers as in the plain epilogue.
    const bool o_issuer = tid % 128 == 0;
    auto store_o_tma = [&](const Sm90Tile& at, int wg_row0, int warp_row0) {
        const u32 o_stage = smem + Shape::kOStageOffset + wg * Shape::kOStageWgBytes;
        float* lse_gmem = p.lse + (static_cast<i64>(at.batch) * p.nheads + at.head) * p.seqlen_q;
        if (o_issuer) bulk_wait_group_read<0>();
        named_barrier_sync(4 + wg, 128);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float l_row = quad_sum(l[0][half]);
            const float inv_l = o_factor(half, l_row);
            const int row = warp * 16 + g + 8 * half;       // in the warpgroup's 64; row % 8 == g
#pragma unroll
            for (int nt = 0; nt < kOCols / 8; ++nt)
                st_shared_u32(o_stage + (nt / 8) * Shape::kOStageChunkBytes + row * 128 + (((nt % 8) ^ g) * 16) + 4 * t,
                              pack2<Elem>(o_acc[0][nt][2 * half] * inv_l, o_acc[0][nt][2 * half + 1] * inv_l));
            const int r = warp_row0 + g + 8 * half;
            if (t == 0 && r < p.seqlen_q) lse_gmem[r] = softmax_lse(m[0][half], l_row, lse_scale());
        }
        fence_proxy_async_smem();                           // the stores, visible to TMA
        named_barrier_sync(4 + wg, 128);
        if (o_issuer && wg_row0 < p.seqlen_q) {
#pragma unroll
            for (int c = 0; c < kChunks; ++c)
                tma_store_4d(&p.tma_o, o_stage + c * Shape::kOStageChunkBytes, c * 64, wg_row0, at.head, at.batch);
            bulk_commit_group();
        }
    };

    int kv_iter = 0, q_iter = 0;    // as the producer counts them: ring slots and Q's phases
    [[maybe_unused]] int gen_iter = 0;   // kDropEarly 4: the K/V blocks whose drawn flags were taken
    // kDynamic: the pingpong turns cannot see whether a tile is the CTA's last with keys (the
    // next one is not claimed yet), so every turn hands over, the first turn is given before the
    // loop, and warpgroup 0 takes the one hand-over left after it (Pingpong's count, header).
    if constexpr (kDynamic) turn.start();
    // kTileOverlap with kDynamic: the next tile, taken from the ring behind the last P V (after_last_pv)
    [[maybe_unused]] int taken_tile = 0;
    auto next_tile = [&](int tile) {
        if constexpr (kDynamic && kTileOverlap) return taken_tile;
        else if constexpr (kDynamic) return ring.take();
        else if constexpr (kStreamTail) return sched.next(tile);
        else return tile + int(gridDim.x);
    };
    // kStreamTail: the partials of the tiles cut in two (sm90_tail.cuh), per consumer thread
    const Sm90TailPartials<Shape::kOCols, kConsumers * 128> partials{reinterpret_cast<float4*>(p.tail_partial),
                                                                     p.tail_flags};
    if constexpr (kTileOverlap) {
        // The first tile's S_0 = Q K_0ᵀ before the loop (the persistent grid has a CTA per tile at
        // most: blockIdx.x is a tile, and with keys (the host's rule), it has blocks): each tile's last
        // step issues the next one's, so one S GEMM is in flight on every path into the loop's head
        // (ptxas serializes wgmmas whose accumulators meet other definitions there: C7515).
        // (kDynamic: the first turn was given above)
        if constexpr (!kDynamic) turn.start();
        turn.begin();
        mbarrier_wait(bar.q_full(), 0);
        mbarrier_wait(bar.k_full(0), 0);
        wgmma_fence();
        issue_s(0);
        turn.end();
    }
    for (int tile = first_tile(); tile < n_tiles; tile = next_tile(tile)) {
        const Sm90Tile at = tile_at(tile);
        const SeqSpan seq = seq_of(tile);                  // fixed lengths: (0, 0, seqlen_q, seqlen_k)
        if constexpr (kVarlen)
            if (past_end(tile, seq)) continue;             // no keys, no rows to store
        const Mask tile_mask = kVarlen ? seq_mask(seq) : mask;
        const int wg_row0 = at.m_block * kBM + wg * 64;
        const int warp_row0 = wg_row0 + warp * 16;         // this warp's 16 rows of S and O
        int n_blocks = kv_blocks(tile), n_end = kv_end(tile);
        narrow(n_blocks, n_end);                           // kStreamTail: the piece's blocks
        const ScoreMod<kSoftcap, kAlibi> score(p.softcap_in, p.softcap_out, p.alibi_slopes,
                                               p.alibi_batch_stride, at.batch, at.head,
                                               p.softmax_scale, kVarlen ? seq.seqlen_q : p.seqlen_q,
                                               kVarlen ? seq.seqlen_k : p.seqlen_k);
        // The feature variants' state (kLazyRescale, kFoldCap) lives in the tile's scope: declared at
        // the kernel's top, these four locals alone made NVVM swap two virtual registers of the
        // dropout kernel (PTX otherwise the same) and ptxas its R0 / R6 (nvcc 13.0); here every
        // instantiation without the variants compiles to the SASS it had before them.
        // kFoldCap: S is kept as t = tanh(S·softcap_in) (softmax_fold.cuh), so the exp2's and the LSE's
        // scales take the factor softcap_out; else the params' own
        const float scale_log2 = kFoldCap ? p.scale_log2 * p.softcap_out : p.scale_log2;
        // kFoldCap 3, 4: the running max is the host's fixed value when it allows one (uniform per launch)
        const bool fixed_max = kFoldCap >= 3 && p.softcap_fixed_m <= 1.f;
        // ALiBi's bias from fp32 distances (softmax_fold.cuh FoldedScoreMod::apply) in the kernels with
        // the feature variants (kLazyRescale or kFoldCap); ScoreMod's integer ones otherwise
        constexpr bool kFastAlibi = kAlibi && (kLazyRescale || kFoldCap != 0);
        bool rescale = true;                               // kLazyRescale: O needs alpha this block
        // kDeferMax: whether this warp's next row-max step may defer its max (softmax_fold.cuh
        // softmax_step_deferred: every row's m within DeferRangeLog2 of t's bound), and the factor
        // that step's O takes (the previous deferred step's move; 1 after a step that was not deferred)
        bool defer_ok = false;
        float alpha_def[1][2] = {{1.f, 1.f}};
        // the row-max step once mx (the block's row max of t) is known: deferred where defer_ok
        auto row_max_step = [&](float (&mx)[1][2]) {
            if constexpr (kDeferMax) {
                if (defer_ok) {
                    softmax_step_deferred<kEmuExp2, Exp2PolyDegree<Elem>::value>(s_acc, m, l, mx, scale_log2, alpha,
                                                                                alpha_def, rescale);
                } else {
                    softmax_step_max<kLazyRescale, kEmuExp2, Exp2PolyDegree<Elem>::value>(s_acc, m, l, l, mx,
                                                                                       scale_log2, alpha, rescale);
                    // (a deferred factor still due: O takes it with this one; m never falls, so once a warp
                    // defers it keeps deferring, and this is for completeness)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        rescale |= alpha_def[0][half] != 1.f;
                        alpha[0][half] *= alpha_def[0][half];
                        alpha_def[0][half] = 1.f;
                    }
                }
                defer_ok = __all_sync(0xffffffffu, deferred_fits<Elem>(m, scale_log2));
            } else {
                softmax_step_max<kLazyRescale, kEmuExp2, Exp2PolyDegree<Elem>::value>(s_acc, m, l, l, mx, scale_log2,
                                                                                   alpha, rescale);
            }
        };
        // kFoldCap's form of the same modifiers (softmax_fold.cuh), and ALiBi's fp32 distances
        // (kFastAlibi); unused without them
        // (kFoldCap 4: S arrives as S·softcap_in, Q prescaled: the tanh's factor is 1, no multiply)
        const FoldedScoreMod<kSoftcap && kFoldCap != 0, kAlibi && (kFoldCap != 0 || kFastAlibi)> folded(
            kFoldCap == 4 ? 1.f : p.softcap_in, p.softcap_out, p.alibi_slopes, p.alibi_batch_stride, at.batch, at.head,
            p.softmax_scale, kVarlen ? seq.seqlen_q : p.seqlen_q, kVarlen ? seq.seqlen_k : p.seqlen_k);
        // kAlibiLinear: ALiBi's bias as one FFMA per score (softmax_fold.cuh AlibiLinear); unused without
        const AlibiLinear alibi_lin(kAlibiLinear, p.alibi_slopes, p.alibi_batch_stride, at.batch, at.head,
                                    p.softmax_scale, p.seqlen_q, p.seqlen_k);
        // O = 0 (kTileOverlap: once the tile's S_0, issued ahead, is done: no instruction but a wgmma
        // may write a wgmma accumulator while one is in flight)
        auto zero_o = [&]() {
#pragma unroll
            for (int nt = 0; nt < kOCols / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) o_acc[0][nt][e] = 0.f;
        };
        if constexpr (!kTileOverlap) zero_o();
        softmax_init(m, l);
        if constexpr (kRoundedL && !kRowSumMma) lr[0][0] = lr[0][1] = 0.f;
        if constexpr (kRowSumMma) {
            lr_acc[0] = lr_acc[1] = lr_acc[2] = lr_acc[3] = 0.f;
            reg_fence(lr_acc);   // (before the wgmma fence of the tile's first P V)
        }

        if (kTileOverlap || n_blocks > 0) {   // (kTileOverlap: non-causal with keys, every tile has blocks)
            // the CTA's last turn: the last tile with keys ends it (Pingpong: end(true))
            bool last_tile = !kDynamic;
            if constexpr (kStreamTail)
                last_tile = sched.last(tile);              // (every piece has keys)
            else if constexpr (!kDynamic)
                for (int next = tile + gridDim.x; next < n_tiles && last_tile; next += gridDim.x)
                    last_tile = kv_blocks(next) == 0;
            // S_j has landed: release K_j (the S GEMM was its only reader) and, after the
            // tile's last S, Q; mask (only the ragged last block and the causal diagonal
            // blocks), online softmax -> P_j (in s_acc), m, l, alpha. reg_fence: no read of S
            // may move above the wgmma wait.
            auto softmax_s = [&](int slot, int j) {
                const int n_block = n_end - 1 - j;
                reg_fence(s_flat);
                bar.release(bar.k_empty(slot), kv_iter + j);   // (kCluster: the partner's too)
                if (j == n_blocks - 1) {
                    if constexpr (kQDouble) mbarrier_arrive(q_empty_of(q_slot(q_iter)));
                    else mbarrier_arrive(bar.q_empty());
                }
                if constexpr (kAlibiLinear) {
                    // causal: every visible key is at or left of its row's diagonal key (σ = +1 on
                    // every block; the keys right of it are masked next); else the block's side of
                    // this warp's diagonals, the exact bias across them
                    const int key0 = n_block * kBN;
                    const int sigma = kCausal ? 1 : alibi_lin.template side<kBN>(warp_row0, key0);
                    float shift[1][2];
                    alibi_lin.apply(s_acc, shift, warp_row0, key0, g, t, sigma);
                    if (tile_mask.template needs_mask<kBN, 64>(wg_row0, n_block))
                        tile_mask.apply(s_acc, warp_row0, key0, g, t, neg_inf());
                    softmax_step_shift<kLazyRescale>(s_acc, shift, m, l, scale_log2, alpha, rescale);
                    return;
                }
                if constexpr (kFoldCap >= 3 && !kAlibi && kMaskedCopy > 0) if (kMaskedCopy == 2 || fixed_max) {
                    // kMaskedCopy: the folded steps below (1: the fixed max's; 2: the row max's too), with
                    // the masked blocks (the causal diagonal's, a ragged end) in a copy of their own, so
                    // that an unmasked block's tanhs, exp2s and the FMA-pipe work around them are one
                    // basic block that ptxas interleaves (below, the mask's branch between the tanhs and
                    // the exp2s splits them: SASS has the block's 64 MUFU.TANH in one burst, then its 64
                    // MUFU.EX2). The masked copy masks S before the tanhs too (tanh(-inf) = -1: masked
                    // again after them); with the same tanhs in both copies the compiler hoisted them
                    // above the branch (nvcc 13.0).
                    const int key0 = n_block * kBN;
                    auto folded_step = [&](auto masked_tag) {
                        constexpr bool kMasked = decltype(masked_tag)::value;
                        float mx[1][2];
                        if (kMasked) tile_mask.apply(s_acc, warp_row0, key0, g, t, neg_inf());
                        if (kMaskedCopy == 1 || fixed_max) {   // the fixed max (below)
                            folded.apply(s_acc, warp_row0, key0, g, t);
                            if (kMasked) tile_mask.apply(s_acc, warp_row0, key0, g, t, neg_inf());
                            mx[0][0] = mx[0][1] = p.softcap_fixed_m;
                            softmax_step_max<kLazyRescale, kEmuExp2, Exp2PolyDegree<Elem>::value,
                                             typename RoundToIf<kRoundedL && !kRowSumMma, Elem>::type>(
                                s_acc, m, l, lr, mx, scale_log2, alpha, rescale);
                        } else if constexpr (kMaskedCopy == 2) {   // the row max on the raw S (below)
                            softmax_rowmax(s_acc, mx);
                            folded.apply(s_acc, warp_row0, key0, g, t);
                            if (kMasked) tile_mask.apply(s_acc, warp_row0, key0, g, t, neg_inf());
                            mx[0][0] = folded.cap(mx[0][0]);
                            mx[0][1] = folded.cap(mx[0][1]);
                            row_max_step(mx);
                        }
                    };
                    if (tile_mask.template needs_mask<kBN, 64>(wg_row0, n_block))
                        folded_step(BoolTag<true>{});
                    else
                        folded_step(BoolTag<false>{});
                    return;
                }
                if constexpr (kFoldCap >= 2 && !kAlibi) {
                    const bool masked = tile_mask.template needs_mask<kBN, 64>(wg_row0, n_block);
                    float mx[1][2];
                    if (kFoldCap >= 3 && fixed_max) {
                        // t <= 1: the host's fixed max (params_sm90.cuh softcap_fixed_m), no row max
                        folded.apply(s_acc, warp_row0, n_block * kBN, g, t);
                        if (masked) tile_mask.apply(s_acc, warp_row0, n_block * kBN, g, t, neg_inf());
                        mx[0][0] = mx[0][1] = p.softcap_fixed_m;
                        // l and, kRoundedL without kRowSumMma, lr: the row sums of P as rounded for the
                        // GEMM (no P is exactly 1 under the fixed max). The step inside this branch: with
                        // it after the branch's end, ptxas (nvcc 13.0) moved its exp2s below the wait for
                        // P_{j-1} V_{j-1} (the step then overlaps only the other warpgroup's GEMMs)
                        softmax_step_max<kLazyRescale, kEmuExp2, Exp2PolyDegree<Elem>::value,
                                         typename RoundToIf<kRoundedL && !kRowSumMma, Elem>::type>(
                            s_acc, m, l, lr, mx, scale_log2, alpha, rescale);
                        return;
                    } else {
                        // the row max on the raw S (tanh is increasing: softmax_fold.cuh), masked
                        // first; the mask again after the tanh, which maps -inf to -1
                        if (masked) tile_mask.apply(s_acc, warp_row0, n_block * kBN, g, t, neg_inf());
                        softmax_rowmax(s_acc, mx);
                        folded.apply(s_acc, warp_row0, n_block * kBN, g, t);
                        if (masked) tile_mask.apply(s_acc, warp_row0, n_block * kBN, g, t, neg_inf());
                        mx[0][0] = folded.cap(mx[0][0]);
                        mx[0][1] = folded.cap(mx[0][1]);
                    }
                    row_max_step(mx);
                    return;
                }
                if constexpr (kFoldCap || (kFastAlibi && !kSoftcap)) folded.apply(s_acc, warp_row0, n_block * kBN, g, t);
                else score.apply(s_acc, warp_row0, n_block * kBN, g, t);
                if (tile_mask.template needs_mask<kBN, 64>(wg_row0, n_block))
                    tile_mask.apply(s_acc, warp_row0, n_block * kBN, g, t, neg_inf());
                if constexpr (kLazyRescale || kFoldCap) {
                    float mx[1][2];
                    softmax_rowmax(s_acc, mx);
                    softmax_step_max<kLazyRescale, kEmuExp2, Exp2PolyDegree<Elem>::value>(s_acc, m, l, l, mx, scale_log2,
                                                                                       alpha, rescale);
                } else if constexpr (kEmuExp2 == 0 && kTreeMax)   // the same step, shorter chains
                    softmax_step_tree(s_acc, m, l, p.scale_log2, alpha);
                else if constexpr (kEmuExp2 == 0)
                    softmax_step(s_acc, m, l, p.scale_log2, alpha);
                else   // kEmuExp2 quarters of S's 8-column tiles take the software exp2
                    softmax_step_emu<kEmuExp2, Exp2PolyDegree<Elem>::value>(s_acc, m, l, p.scale_log2, alpha);
            };
            // dropout (Algorithm 2): l summed the undropped P_j in softmax_s; P_j ∘ Z is what
            // O += P_j V_j takes (the epilogue divides by l (1 - p)). Run just before P_j is packed, once P_{j-1}'s
            // fragments are dead (their GEMM has completed): the Philox rounds need registers
            // that S_j, O and P_{j-1} together leave too few of (ptxas spilled with it in softmax_s)
            // kDropPacked: the same mask on the packed fragments, after pack_p (dropout_packed.cuh)
            auto drop_p = [&](int j) {
                if constexpr (kDropout && !kDropPacked)
                    dropout.zero_dropped(s_acc, at.batch * p.nheads + at.head, warp_row0, (n_end - 1 - j) * kBN, g, t);
            };
            // kDropEarly: the keep flags of P_j drawn in the wait for S_j (draw_early, before the wgmma
            // wait), applied after the packing (drop_packed): dropout_packed.cuh
            u32 keep_flags[kDropEarly ? kBN / 32 : 1][4][kDropEarly == 2 ? 2 : 1];
            (void)keep_flags;
            auto draw_early = [&](int j) {
                if constexpr (kDropEarly == 4) {
                    // the flags the producer warpgroup drew (call blk of this thread at c = blk · 128 +
                    // its index in the warpgroup: 16-byte loads, a warp's 512 bytes contiguous), then
                    // this warpgroup's part released
                    mbarrier_wait(gen_full(wg), u32(gen_iter) & 1);
                    const int ct = tid % 128;
#pragma unroll
                    for (int blk = 0; blk < kBN / 32; ++blk) {
                        u32 f[4];
                        ld_shared_v4(gen_part(wg) + (blk * 128 + ct) * 16, f);
#pragma unroll
                        for (int ct4 = 0; ct4 < 4; ++ct4) keep_flags[blk][ct4][0] = f[ct4];
                    }
                    mbarrier_arrive(gen_empty(wg));
                    ++gen_iter;
                } else if constexpr (kDropEarly == 5) {   // (timing only: no draw, every flag set)
#pragma unroll
                    for (int blk = 0; blk < kBN / 32; ++blk)
#pragma unroll
                        for (int ct = 0; ct < 4; ++ct) {
                            keep_flags[blk][ct][0] = swar.m | 0x80808080u;
                            asm volatile("" : "+r"(keep_flags[blk][ct][0]) :: "memory");
                        }
                } else if constexpr (kDropEarly == 6) {   // (timing only: nothing drawn or applied)
                } else if constexpr (kDropEarly)   // (3: form 1 without the Philox rounds, for timing only)
                    draw_keep_flags<kBN / 32, kDropEarly == 2 ? 2 : 1, kDropEarly == 3 ? 0 : kPhiloxRounds>(
                        dropout, swar, keep_flags, at.batch * p.nheads + at.head, warp_row0,
                                    (n_end - 1 - j) * kBN, g, t);
            };
            auto drop_packed = [&](int j) {
                if constexpr (kDropEarly == 6) {
                } else if constexpr (kDropEarly)
                    and_keep_flags(p_frag, keep_flags);
                else if constexpr (kDropPacked)
                    zero_dropped_packed(dropout, p_frag, at.batch * p.nheads + at.head, warp_row0,
                                        (n_end - 1 - j) * kBN, g, t);
            };
            auto phase = [&](int j) { return u32((kv_iter + j) / kStages) & 1; };
            auto slot_of = [&](int j) { return (kv_iter + j) % kStages; };

            if (!kTileOverlap && !kDynamic && q_iter == 0) turn.start();  // the CTA's first tile with keys
            if constexpr (!kTileOverlap) mbarrier_wait(q_full_of(q_slot(q_iter)), q_fill(q_iter) & 1);
            if constexpr (kFoldCap == 4) {
                // Q_i·softcap_in in place (softmax_fold.cuh prescale_q): this warpgroup's rows, then
                // visible to its wgmmas (async proxy) once all 128 threads have written theirs
                prescale_q<kChunks, Shape::kQChunkBytes>(q_smem + wg * 64 * 128, p.softcap_in, tid % 128);
                fence_proxy_async_smem();
                named_barrier_sync(4 + wg, 128);
            }
            if constexpr (kQDouble) q_buf_shift = q_slot(q_iter) ? u32(Shape::kQ2Offset) >> 4 : 0u;
            // the tile's K/V blocks (sm90_fwd_common.cuh: the steps, FA3's pipeline), with this
            // kernel's parts. kTileOverlap: S_0 was issued by the last step (or before the loop), and
            // the last P V stays in flight behind the next tile's S_0.
            auto to_p = [&](int j) {
                drop_p(j);                         // kDropout: P_j ∘ Z
                pack_p();                          // P_j: A fragments, or (kPSmem) the P tile
                drop_packed(j);                    // kDropPacked: P_j ∘ Z on the fragments
            };
            auto rescale_o = [&]() {
                if constexpr (kRowSumMma) reg_fence(lr_acc);   // (after the P V wait, as O)
                if constexpr (!kRescaleFirst)      // (kRescaleFirst: in step j + 1, under S_{j+1})
                    if (!kLazyRescale || rescale) {  // kLazyRescale: only when m moved
                        softmax_rescale(o_acc, alpha); // O *= alpha_j: O now relative to m_j
                        if constexpr (kRowSumMma) {    // and its row sum of P̃ with it
                            lr_acc[0] *= alpha[0][0];
                            lr_acc[1] *= alpha[0][0];
                            lr_acc[2] *= alpha[0][1];
                            lr_acc[3] *= alpha[0][1];
                        }
                    }
                if constexpr (kRowSumMma) reg_fence(lr_acc);   // (before the next wgmma fence)
            };
            auto first_landed = [&]() {
                if constexpr (kTileOverlap) zero_o();
            };
            auto rescale_first = [&](bool in_loop) {
                if constexpr (kRescaleFirst) {
                    softmax_rescale(o_acc, alpha);     // O *= alpha_{j-1}, under S_j's GEMM (or the last)
                    if (in_loop) {
                        reg_fence(o_flat);
                        wgmma_fence();                 // the multiplies, before P V reads O
                    }
                }
            };
            auto after_last_pv = [&]() {
                if constexpr (kTileOverlap) {
                    // The next tile's S_0 = Q' K'_0ᵀ right behind this last P V (in the same turn), so the
                    // tensor cores compute it while this tile's epilogue runs (the pipeline's fill, hidden
                    // once per tile). Its Q' and K'_0 are loading already: the producer went on to them
                    // once every consumer released Q and the K slot (this tile's last S, issued in an
                    // earlier turn of each warpgroup: no wait here depends on a later turn), and s_acc is
                    // free (P_{n-1} is in p_frag). The CTA's last tile issues the same GEMM on what is
                    // still in shared memory (its Q and last K block: nothing loads after them) and drops
                    // it: issued on every path, the S GEMM in flight is the same at the loop's head.
                    // (kDynamic: the next tile is taken here, its claim made by the producer once it
                    // had issued this tile's last loads; the loop's next_tile returns it)
                    bool has_next;
                    if constexpr (kDynamic) {
                        taken_tile = ring.take();
                        has_next = taken_tile < n_tiles;
                    } else {
                        has_next = tile + int(gridDim.x) < n_tiles;
                    }
                    if (has_next) {
                        mbarrier_wait(q_full_of(q_slot(q_iter + 1)), q_fill(q_iter + 1) & 1);
                        mbarrier_wait(bar.k_full(slot_of(n_blocks)), phase(n_blocks));
                        // kQDouble: S_0 reads the next tile's Q buffer (the loop's head sets the same)
                        if constexpr (kQDouble) q_buf_shift = q_slot(q_iter + 1) ? u32(Shape::kQ2Offset) >> 4 : 0u;
                    }
                    reg_fence(s_flat);
                    wgmma_fence();
                    issue_s(slot_of(has_next ? n_blocks : n_blocks - 1));
                }
            };
            // (kDropEarly: P_j's keep flags drawn while S_j computes; kTileOverlap: P_{n-1} V_{n-1} is in
            // O once one group is left, the groups completing in order)
            if constexpr (kRagKeys > 0)   // the first block in loop order holds at most kRagKeys keys
                rag_pv = p.seqlen_k - (n_end - 1) * kBN <= kRagKeys;
            if constexpr (kSAhead) {
                // S_{j+1} issued before the softmax of S_j, into s_next (sm90_consume_blocks_ahead,
                // above); moved into s_acc once landed
                auto issue_s_ahead = [&](int slot) {
                    if constexpr (kSAhead) issue_s_into(s_next, slot);
                };
                auto take_s_ahead = [&]() {
                    if constexpr (kSAhead) {
                        reg_fence(s_next);
#pragma unroll
                        for (int i = 0; i < kBN / 2; ++i) s_flat[i] = s_next[i];
                    }
                };
                sm90_consume_blocks_ahead(bar, turn, kv_iter, n_blocks, last_tile, s_flat, s_next, o_flat, issue_s,
                                          issue_s_ahead, take_s_ahead, issue_pv, softmax_s, to_p, rescale_o);
            } else {
                sm90_consume_blocks<!kTileOverlap, kTileOverlap ? 1 : 0, kPvOverlap>(
                    bar, turn, kv_iter, n_blocks, last_tile, s_flat, o_flat, issue_s, issue_pv, softmax_s, to_p,
                    rescale_o, draw_early, first_landed, rescale_first, after_last_pv);
            }
            kv_iter += n_blocks;
            ++q_iter;
            if constexpr (kRowSumMma) reg_fence(lr_acc);   // (read below, after the last P V's wait)
        }

        if constexpr (kStreamTail) {
            // a tile cut in two (sm90_tail.cuh): its later blocks' piece stores its partial for the
            // finisher, which runs the first blocks last in its CTA and merges it before the epilogue
            if (sched.writer()) {
                partials.store(sched.range(), tid - 128, o_acc, m, l);
                continue;
            }
            if (sched.finisher()) partials.merge(sched.range() + 1, tid - 128, o_acc, m, l, p.scale_log2);
        }
        if constexpr (kTmaStore) {
            store_o_tma(at, wg_row0, warp_row0);
            continue;
        }
        // ---- epilogue: O = acc / l (delayed normalization), LSE = m·scale + log l, from registers
        // (sm90_fwd_common.cuh). A Q block with no visible key (n_blocks = 0) stores O = 0 and LSE = +inf.
        sm90_store_o_lse<Elem, kOCols, kVarlen>(p, at, seq, o_acc, m, l, o_factor, lse_scale, warp_row0, g, t);
    }
    if constexpr (kTileOverlap) wgmma_wait<0>();   // the last tile's dropped S GEMM
    if constexpr (kDynamic && kPingpong)
        if (wg == 0) named_barrier_sync(1, 256);   // the last warpgroup's final hand-over
    if constexpr (kTmaStore)
        if (o_issuer) bulk_wait_group<0>();        // no store may read shared memory after the exit
}


template <int kBM, int kBN, int kStages, int kConsumers, bool kPingpong, bool kPersistent, int kHeadDim,
          class Elem, bool kCausal, bool kWindow = false, bool kSoftcap = false, bool kAlibi = false,
          bool kDropout = false, int kEmuExp2 = 0, bool kDynamic = false, bool kTmaStore = false,
          bool kVarlen = false, bool kPSmem = false, bool kTreeMax = false, bool kQDouble = false,
          bool kLazyRescale = false, int kFoldCap = 0, bool kAlibiLinear = false, bool kRescaleFirst = false,
          bool kTileOverlap = false, bool kDropPacked = false, int kDropEarly = 0, bool kStreamTail = false,
          bool kPvOverlap = false, int kMaskedCopy = 0, int kRagKeys = 0, bool kPrefetch = false, bool kSAhead = false,
          bool kDeferMax = false>
__global__ void __launch_bounds__((kConsumers + 1) * 128, 1)
sm90_fwd(const __grid_constant__ Sm90FwdParams p) {
    sm90_fwd_body<kBM, kBN, kStages, kConsumers, kPingpong, kPersistent, kHeadDim, Elem, kCausal, kWindow, kSoftcap, kAlibi,
                  kDropout, kEmuExp2, kDynamic, kTmaStore, kVarlen, kPSmem, kTreeMax, kQDouble, kLazyRescale, kFoldCap,
                  kAlibiLinear, kRescaleFirst, kTileOverlap, kDropPacked, kDropEarly, kStreamTail, kPvOverlap, false, kMaskedCopy,
                  kRagKeys, kPrefetch, kSAhead, kDeferMax>(p);
}

// kCluster's entry point: a cluster of 2 CTAs (adjacent Q blocks of one head, sharing their K/V loads);
// kClusterSize (2) leads the template arguments so that its instantiations differ from sm90_fwd's.
template <int kClusterSize, int kBM, int kBN, int kStages, int kConsumers, bool kPingpong, bool kPersistent, int kHeadDim,
          class Elem, bool kCausal, bool kWindow = false, bool kSoftcap = false, bool kAlibi = false,
          bool kDropout = false, int kEmuExp2 = 0, bool kDynamic = false, bool kTmaStore = false,
          bool kVarlen = false, bool kPSmem = false, bool kTreeMax = false, bool kQDouble = false,
          bool kLazyRescale = false, int kFoldCap = 0, bool kAlibiLinear = false, bool kRescaleFirst = false,
          bool kTileOverlap = false, bool kDropPacked = false, int kDropEarly = 0, bool kStreamTail = false,
          bool kPvOverlap = false, int kMaskedCopy = 0, int kRagKeys = 0, bool kPrefetch = false, bool kSAhead = false,
          bool kDeferMax = false>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__((kConsumers + 1) * 128, 1)
sm90_fwd_cluster(const __grid_constant__ Sm90FwdParams p) {
    static_assert(kClusterSize == 2, "sm90_fwd_cluster: clusters of 2 CTAs");
    sm90_fwd_body<kBM, kBN, kStages, kConsumers, kPingpong, kPersistent, kHeadDim, Elem, kCausal, kWindow, kSoftcap, kAlibi,
                  kDropout, kEmuExp2, kDynamic, kTmaStore, kVarlen, kPSmem, kTreeMax, kQDouble, kLazyRescale, kFoldCap,
                  kAlibiLinear, kRescaleFirst, kTileOverlap, kDropPacked, kDropEarly, kStreamTail, kPvOverlap, true, kMaskedCopy,
                  kRagKeys, kPrefetch, kSAhead, kDeferMax>(p);
}

}  // namespace cuflash
