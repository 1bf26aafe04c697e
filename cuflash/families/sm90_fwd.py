"""sm90_fwd: the FlashAttention forward for Hopper (kernels_cu/sm90_fwd.cu), sm_90a only.

FA3's structure: a producer warpgroup loads Q once and K/V blocks by TMA into a ring of
shared-memory slots (K and V each with full / empty mbarriers); 1, 2 or 3 consumer
warpgroups of 64 query rows each compute S = Q Kᵀ by wgmma (SS), the online softmax in exp2,
and O += P V by wgmma with P from registers (RS); setmaxnreg moves registers from the
producer to the consumers (FA3's splits, producer / consumer: 56 / 256, 24 / 240, 32 / 160).

The consumer loop is FA3's software pipeline: S_j = Q K_jᵀ is issued together with
O += P_{j-1} V_{j-1}, the softmax of S_j runs while the tensor cores compute P_{j-1} V_{j-1},
and O is rescaled once that GEMM is done. With ``pingpong`` the 2 or 3 consumer warpgroups
also take turns, round robin on named barriers, to issue their GEMMs, so one warpgroup's
softmax hides under the others' GEMMs. K and V have separate empty barriers, so the next K
load starts as soon as S_j is done.

Selection: ``priority = 1``, above fa2_fwd, so on sm_90 this family runs every forward it
supports (every head dim up to 256: the kernels are compiled for 64, 96, 128, 192 and 256 and
smaller head dims zero-fill the missing columns by TMA); elsewhere fa2_fwd. Head dim 96 is exact
in compute (6 k16 steps for S, an N = 96 wgmma for P V, 96 columns of O accumulators) and keeps
d128's shared-memory layout (two 128-byte-swizzled chunks, the second half zeros): its tiles
take d128's shared memory. Dropout (``dropout``, kDropout): philox.cuh's Dropout::zero_dropped on P_j
after the softmax (l and the LSE stay plain attention's), the same keep mask as fa2_fwd's, which
fa2_bwd regenerates; at DROPOUT_BN (the Philox rounds need registers). Variable-length batches
(``varlen``, kVarlen, set from the call): tiles (Q block, head, sequence) over a grid sized for
the longest sequence, tensor maps over the whole packed (total, heads, d) tensors with box rows
from cu_seqlens, keys past a sequence's end masked and rows past it not stored; with window,
softcap, ALiBi and dropout as VARLEN_FEATURES lists (others fall back to fa2_fwd). FA3's d64 tile,
192 x 192 over 3 consumer warpgroups, takes ``p_smem`` (P through shared memory, O += P V a wgmma
SS: with P's fragments in registers the 3-consumer budget caps BN at 128); ``tree_max`` (shorter
row-max chains) and ``q_double`` (two Q buffers) are heuristic switches for the short d64 tiles
(HEURISTIC_D64). Not implemented: clusters (FP8 is its own family, sm90_fwd_fp8).

Host side: the kernel reads Q, K, V through TMA tensor maps (``cuTensorMapEncodeTiled``,
called through ctypes on libcuda.so.1, loaded lazily: without a driver the family still
imports and compile-checks). A map embeds the tensor's address, so the maps are written into
the packed params on every call (``call_writer``): each plan keeps the three maps of an
address triple as one block, encoded from a module cache keyed by (pointer, shape, strides,
box).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from typing import Optional

import numpy as np

from ..problem import Problem
from ..registry import register
from ..features import feature_params, name_suffix, template_suffix
from .base import Family, KernelConfig, LaunchSpec, default_max_smem
from .fa2_fwd import (check_head_dim, dropout_mix, dropout_params, feature_mix, first_fitting, forward_sizes,
                      is_varlen, strides3)

HEAD_DIMS = (64, 96, 128, 192, 256)
MAX_SMEM = 227 * 1024          # the H100's opt-in maximum per CTA
# fp32 accumulator registers a consumer thread keeps live (O: head_dim / 2, S: BN / 2), by
# consumer warpgroups (setmaxnreg budget 256 / 240 / 160 minus addresses, m, l, P fragments).
# ptxas (nvcc 13.0, sm_90a) spills nothing up to these; tests/test_sm90_cpu.py holds it to that.
MAX_ACCUM_REGS = {1: 192, 2: 176, 3: 96}
# The same with p_smem (P through shared memory: no register holds P's BN / 4 A fragments), where
# it raises the budget: 3 consumer warpgroups take head dim 64 with BN 192 (FA3's d64 tile), 128
# accumulators, without a spill (nvcc 13.0, sm_90a; tests/test_sm90_psmem_cpu.py holds it to that);
# the causal mask needs a few registers more: 120 there (d64 BN 192 causal spilled 12 bytes). The
# TMA-store epilogue with 3 consumer warpgroups spilled even at BN 176 (8 bytes): refused. p_smem
# is for 3 consumer warpgroups only: with 1 or 2 the registers hold P next to any tile that fits
# shared memory, so the flag would only double their part of the tuning space.
MAX_ACCUM_REGS_PSMEM = {3: 128}
# The TMA-store epilogue with 3 consumer warpgroups and P in registers: O, S and P's fragments
# (accum_regs + BN / 4) at most 116 per thread; d64 BN 128 (96 + 32 = 128) spilled 4 bytes, BN 112
# (88 + 28) none (nvcc 13.0, sm_90a).
TMA_STORE_C3_REGS = 116
MAX_ACCUM_REGS_PSMEM_MASKED = {3: 120}
# p_smem's features: none (its instantiations with window, softcap, ALiBi, dropout or varlen are
# unchecked for registers): a config with one of them and p_smem is refused.
# BN of a dropout forward (2 consumer warpgroups), by head dim: the largest multiple of 32 (one
# Philox call covers 32 keys, philox.cuh) at which ptxas (nvcc 13.0, sm_90a) spills nothing
# with the Philox rounds (kDropout), which run once P_{j-1}'s fragments are dead: one call per
# 16 elements since the 32-key layout (it was one call and a 4 x 4 quad transpose per 16,
# which capped d64 / d128 at 128). One step up: d128 BN 192 spills 4 bytes; d192 BN 128 and
# d256 BN 96 exceed shared memory. tests/test_sm90_dropout_cpu.py holds it to that.
DROPOUT_BN = {64: 192, 96: 160, 128: 160, 192: 96, 256: 64}
# emu_exp2 (kEmuExp2): quarters of S's 8-column tiles whose exp2 runs on the FMA / ALU pipes
# (kernels_cu/exp2_emu.cuh). Legal values, and the tuning space's (all emulated, 4, moves the
# bottleneck to the FMA pipes: ~10 instructions against one SFU op at 1/8 of the FMA rate).
EMU_EXP2 = (0, 1, 2, 3, 4)
EMU_EXP2_SPACE = (0, 1, 2, 3)
# The heuristic's emu_exp2 with softcap: 0. Measured on the H100 (tests/sm90_softcap_timing.py,
# results/NVIDIA_H100_80GB_HBM3/softcap_timing.json; bf16 d128 8k, softcap 30, BN 176): softcap
# costs 1.34x / 1.38x the plain forward (causal / not) with the SFU's exp2, and 1.44x / 1.49x
# at 1 or 2 quarters emulated, 1.68x / 1.74x at 4: the softcap kernel is bound by instruction
# issue, not by the SFU, and the polynomial's ~10 instructions per score cost more than the
# ex2.approx they replace. The plain d64 forward, tried as an option, was slower at every
# fraction too (1.04x-1.23x), so the knob is tuned with softcap only.
SOFTCAP_EMU_EXP2 = 0
# Whether the heuristic runs the dynamic persistent scheduler (and, at d128 below 16k keys, the
# TMA-store epilogue): see Sm90Forward.heuristic for the measurement.
HEURISTIC_DYNAMIC = True
# Whether a dropout call (dropout alone, fixed lengths) runs the dynamic persistent scheduler too
# (without the TMA-store epilogue: its staging tiles spill next to the Philox rounds at d128).
# Measured on the H100 (tests/sm90_dropout_timing.py, bf16 8k, p = 0.1, same process): forward
# 0.93-0.99x the static tiles' time (d128 causal 1.295 -> 1.210 ms, d64 causal 1.856 -> 1.730,
# d128 full 2.444 -> 2.410, d64 full 3.405 -> 3.362), forward + backward 0.98-1.00x.
DROPOUT_DYNAMIC = True
# Whether dropout calls apply the keep mask to P's packed fragments (drop_packed, kDropPacked): the
# same mask bit for bit. The fp32 form (Dropout::zero_dropped) spends a compare and a select per
# element, 4-5 instructions per element in the d128 BN 160 kernel's SASS (next to the Philox rounds'
# ~3 and the plain softmax's ~7); the packed form 2 (256 fewer instructions in the kernel). Measured
# on the H100 (tests/features_overhead_timing.py, session 16 round A, bf16 d128 8k, batch 2 x 16
# heads, p 0.1, x the plain forward of the same process, causal / full): 1.588 / 1.686 -> 1.526 /
# 1.625; at BN 192 1.551 / 1.647, with the TMA store (BN 160) 1.555 / 1.660: on at head dim 128 (the
# kernel head dims listed), at the heuristic's BN; the others keep the fp32 form until measured.
DROPOUT_PACKED: frozenset = frozenset({128})
# BN of a drop_packed forward by head dim, where wider than DROPOUT_BN: the Philox rounds run after
# the packing, where S's fp32 registers are dead, and d128 BN 192 compiles without a spill (nvcc
# 13.0, sm_90a; 168 registers), also BN 128 / 160 with the TMA-store epilogue. Others: DROPOUT_BN.
# (BN 192 measured slower than the heuristic's 160: DROPOUT_PACKED's note.)
DROPOUT_PACKED_BN = {128: 192}
# Whether drop_packed calls draw the keep mask early (drop_early, kDropEarly; kernels_cu/
# dropout_packed.cuh): P_j's Philox rounds in the wait for S_j's wgmma, the keep flags as byte signs
# (one register per 4 elements), a permute and an AND per two elements after the packing. The same
# mask bit for bit. {head dim (of DROPOUT_PACKED's): form (1 byte signs, 2 fragment masks)}. Measured
# on the H100 (session 17 round 1, tests/sm90_dropout_timing.py --quick, bf16 d128 8k, 2 x 16 heads,
# p 0.1, x the plain call of the same process, full / causal): forward drop_packed 1.524 / 1.477,
# form 1 (BN 160) 1.456 / 1.397, form 2 (BN 128) 1.444 / 1.411; forward + backward 1.595 / 1.581 ->
# 1.543 / 1.571 (form 1), 1.569 / 1.551 (form 2). Form 1 at d128: the softmax section's instruction
# count fell from 948 to 695 (plain 622) but the time only 4-5%: the Philox rounds still run on the
# consumer warps.
# Form 4 (the producer warpgroup's warps 1-3 draw, static grid): correct on the H100 (round 3:
# tests/test_drop_early_gpu.py) but 2.225x the plain forward against form 1's 1.449x on the same grid
# (full, 8k): three warps of 40 registers do not draw a block's 1280 calls within a step, so the
# consumers wait for them. Form 3 (no rounds, timing only): 1.122x / 1.077x (full / causal): the
# rounds are the overhead; their home is still open. Session 21 (an H200, full / causal, x plain):
# form 1 with the calls' counters derived once per K/V block 1.504 / 1.357 against form 1's 1.442 /
# 1.353, and that with the Philox words compared after the packing as fp16 lanes (set.ge.u32.f16x2:
# 12% fewer instructions, the compare on the path from S_j to P_j V_j) 1.473 / 1.416: neither
# faster, both removed. ncu (causal): form 1 410M instructions against the plain call's 272M, issue
# active 41% (plain 38%), tensor pipe 56% of the time (plain 78%).
DROPOUT_EARLY: dict = {128: 1}
# The widest BN of drop_early 2 (the fragment masks: BN / 4 registers from the wait for S_j to the
# packing): d128 BN 160 spilled 16 bytes, BN 128 none (nvcc 13.0, sm_90a).
DROP_EARLY_MASKS_BN = 128
# drop_early 3: form 1 with the Philox counters for words (no rounds): NOT the dropout mask, a timing
# form that measures what the rounds cost (tests/sm90_dropout_timing.py --rounds-cost sets this);
# 5: no draw, every flag kept, the permute and AND applied; 6: nothing drawn or applied (the dropout
# kernel's epilogue scale only). Timing forms too (tests/drp8_timing.py).
DROP_EARLY_TIMING = False
# ... and of drop_early 1 (the byte signs, BN / 8 registers): BN 160 compiles without spills at d128;
# wider is unchecked (drop_packed's BN 192, a forced config's: the byte signs' registers on top).
DROP_EARLY_SIGNS_BN = 160
# The dynamic scheduler (``dynamic``, kDynamic): bytes of K and V that a section of the tile order
# keeps in L2 (the H100 has 50 MB; FA3 sizes its sections by 32 MB too), and the shared memory
# its tile ring takes (2 full + 2 empty mbarriers, 2 int32 tile indices: Sm90FwdShape::kRingBytes).
SCHED_L2_BYTES = 32 * 1024 * 1024
# The largest explicit ``section`` (KV heads per section of that order; 0 is the L2 rule above).
MAX_SECTION = 1024
# The heuristic's tile for plain head-dim-64 calls, by causal: changes to the 2-consumer dynamic tile
# (BM 128, BN 192; {} keeps it), from the seqlen bucket HEURISTIC_D64_MIN_BUCKET on. Measured on
# the H100 (tests/sm90_fwd_d64_timing.py, bf16, dim 2048, batch x seqlen 16k, same process as SDPA
# cuDNN; round A of session 14): 3 consumer warpgroups, BM 192, BN 128 (P in registers; FA3's causal
# d64 tile) ran at 1.05 / 1.08 / 1.17 / 1.25x cuDNN non-causal at 2k / 4k / 8k / 16k and 1.00 /
# 1.07 / 1.16 / 1.21x causal, where the 2-consumer tile ran at 0.91 / 0.93 / 0.98 / 1.08x and
# 0.91 / 0.97 / 1.02 / 1.05x. p_smem's BN 176 / 192 (FA3's non-causal tile) came close (1.02-1.21x)
# but no faster, except BN 176 at 8k non-causal (1.174x against 1.170x). Below the 2048 bucket
# (BM 192 leaves more of the last Q block empty) it is unmeasured: the 2-consumer tile stays.
HEURISTIC_D64: dict = {False: dict(BM=192, consumers=3, BN=128), True: dict(BM=192, consumers=3, BN=128)}
HEURISTIC_D64_MIN_BUCKET = 2048
# Short keys (issue 12: ViT 197 / 577 tokens, BERT 128 / 512): plain non-causal head-dim-64 calls with at most
# SHORT_KEYS_MAX keys take the K/V block width of SHORT_KEYS_BNS that pads seqlen_k the least (ties: the fewest
# blocks; short_keys_bn: 197 -> 112, 128 -> 128, 257 -> 144, 512 -> 128, 577 -> 160), on the 2-consumer
# dynamic tile, where BN 192 padded 197 keys to 384 and 128 to 192. Measured on one H200 (session 30, sb1 round 2,
# tests/short_seq_timing.py, bf16, forward alone x BN 192 in the same process, two processes A / B;
# results/NVIDIA_H200/logs/session30_sb1/r2): 64 x 197 x 12 heads 0.763 / 0.767 (BN 112; BN 128 0.790, 144 0.849,
# 160 0.912, 176 0.971), 128 x 128 x 12 0.881 / 0.863 (BN 128), 32 x 512 x 12 BN 128 0.921 (BN 176 0.957 / 0.956),
# 64 x 577 x 16 0.882 / 0.883 (BN 160; BN 128 0.889); fp16 64 x 197 0.763 (A). The non-persistent grid was
# slower (1.01-1.25x). cuDNN's forward stays faster there (0.69-0.86x of BN 192's time). Longer keys keep BN 192;
# causal calls take SHORT_CAUSAL_FIELDS (below); select.choose_on_device caches short calls per seqlen_k (SHORT_EXACT).
SHORT_KEYS_MAX = 768
SHORT_KEYS_BNS = (112, 128, 144, 160, 176, 192)


# The schedule of those short calls (session 31, sb2; issue 12), bf16 and fp16 alike: SHORT_KEYS_FIELDS on the
# short-key tile of plain non-causal calls (with its BN, up to SHORT_KEYS_MAX keys), SHORT_CAUSAL_FIELDS on plain
# causal calls below HEURISTIC_D64_MIN_BUCKET (the 2-consumer tile; BN 128 = BM: one diagonal block per Q tile, where
# BN 192 crossed the diagonal with a partly empty block). Measured on one H200 (tests/short_seq_timing.py, forward
# alone x main's tile in the same process, two processes A / B; results/NVIDIA_H200/logs/session31_sb2/r1, r2):
# * non-causal: r1 (bf16, one field on the short-key tile), the TMA-store epilogue 256 x 197 x 12 0.911 / 0.911,
#   256 x 128 x 12 0.808 / 0.807 (at 197 and 128 keys, A: no pingpong 0.926 and 0.972, static 0.977 and 0.954,
#   q_double 1.02, tile_overlap 0.99 and 1.06, 4 stages 1.00, BM 64 1.45); r2 (tma_store as the default, static on
#   top of it, x main): 256 x 197 x 12 0.909 -> static 0.862 / 0.861, fp16 0.910 -> 0.863 / 0.869, 256 x 128 x 12
#   0.805 -> 0.788 / 0.790, 128 x 512 x 12 0.949 -> 0.894 / 0.893, 64 x 577 x 16 0.990 -> 0.950 / 0.953 (no pingpong
#   instead, A: 0.866, 0.864, 0.805, 0.935, 0.940); SDPA cuDNN 0.899, 0.902, 0.693, 0.853, 0.979 (A) there. Static
#   persistent, as HEURISTIC_NC's longer non-causal calls: equal tiles leave the dynamic scheduler no imbalance to fix.
# * causal, BN 128 + q_double + tma_store: r1 (bf16 x BN 192) 32 x 512 x 12 0.793 / 0.792, 32 x 1024 x 12 0.845 /
#   0.839 (at 512 and 1024, A: BN 128 alone 0.917 and 0.943, tma_store alone 0.934 and 0.982, q_double alone 1.05,
#   BM 192 0.97 and 1.01, static 1.26 and 1.28); r2 (as the default, x main) 128 x 256 x 12 0.669 / 0.665, 32 x 512
#   0.795 / 0.795, 32 x 1024 0.845 / 0.847, 16 x 1440 (the bucket's edge) 0.890 / 0.890; without q_double 1.00-1.03x,
#   without tma_store 1.09-1.24x, no pingpong 0.99-1.02x, BN 192 1.07-1.34x the default; SDPA cuDNN 0.595, 0.751,
#   0.819, 0.907 of main's time there.
SHORT_KEYS_FIELDS: dict = dict(tma_store=True, dynamic=False)
SHORT_CAUSAL_FIELDS: dict = dict(BN=128, q_double=True, tma_store=True)


def short_keys_bn(seqlen_k: int) -> int:
    """The BN of SHORT_KEYS_BNS whose blocks cover seqlen_k with the fewest padded keys, then the fewest blocks."""
    return min(SHORT_KEYS_BNS, key=lambda bn: (-(-seqlen_k // bn) * bn, -(-seqlen_k // bn)))

# q_double (two Q buffers: a tile's first S does not wait for its Q load) on that d64 tile, by (causal,
# seqlen bucket). Measured on the H100 (session 16, tests/sm90_fwd_cells_timing.py, bf16, back to back,
# samples interleaved, x SDPA cuDNN of the same rounds): causal 2k 0.986 / 0.987 / 0.984 -> 1.006 /
# 1.001 / 1.013 in three rounds (tree_max: 1.001 / 0.982 / 0.964). Other buckets unmeasured.
HEURISTIC_D64_Q_DOUBLE: frozenset = frozenset({(True, 2048)})
# The heuristic's schedule for plain non-causal calls at head dims 128 and 256: changes to the dynamic
# pingpong tile, from the seqlen bucket HEURISTIC_NC_MIN_BUCKET on ({} keeps it). Non-causal tiles are
# all equally long, so the dynamic scheduler has no imbalance to fix, and its section order (several
# KV heads at once) read K/V from L2 worse than the static persistent order (a wave's CTAs on one or
# two heads). Measured on the H100 (tests/sm90_fwd_nc_timing.py, session 15 round A,
# results/NVIDIA_H100_80GB_HBM3/nc_timing_round_a.json: bf16, dim 2048, batch x seqlen 16k, same process
# as SDPA cuDNN; single calls after an L2 flush, TFLOPs at 2k / 4k / 8k / 16k):
#   d128 (BN 160 + TMA store below 16k keys, BN 176 from 16k, pingpong): dynamic 618 / 659 / 683 / 662,
#        static persistent 652 / 684 / 689 / 666 (1.02-1.07x cuDNN), dynamic with one-KV-head sections
#        653 / 686 / 688 / 669 (the same within noise: the order is what matters);
#   d256 (BN 80): dynamic pingpong 626 / 688 / 724 / 708, static persistent without pingpong (FA3 runs
#        d256 without its warpgroup scheduler barrier too) 651 / 714 / 748 / 756 (0.97 / 1.01 / 1.05 /
#        1.13x cuDNN), with pingpong 642 / 701 / 728 / 721.
# (The back-to-back samples of the same run lose ~1-2% per row along the row order at 16k: the GPU's
# clock sinks under sustained load and recovers during the slower SDPA flash rows, so the first row
# after them looked fastest; the flushed single calls start alike.)
# Checked in round B (results/NVIDIA_H100_80GB_HBM3/nc_timing.json; rotated row order, TFLOPs and
# x cuDNN at 2k / 4k / 8k / 16k), this schedule against the dynamic one:
#   bf16 d128 flushed 669 / 701 / 710 / 680 (1.03 / 1.05 / 1.07 / 1.04x) against 634 / 673 / 693 / 686,
#             back to back 606 / 634 / 657 / 689 (1.04 / 1.06 / 1.08 / 1.16x) against 601 / 632 / 657 / 681;
#   bf16 d256 flushed 663 / 724 / 764 / 759 (0.98 / 1.01 / 1.06 / 1.09x) against 637 / 698 / 736 / 724,
#             back to back 621 / 664 / 716 / 784 (1.00 / 1.03 / 1.12 / 1.30x) against 603 / 637 / 691 / 743;
#   fp16 d128 flushed 1.03-1.10x, back to back 1.04-1.10x; fp16 d256 flushed 0.98 / 1.01 / 1.05 / 1.07x,
#             back to back 1.00 / 1.05 / 1.10 / 1.16x (dynamic: 0.94-1.08x).
# rescale_first on these tiles: d256 slower in every cell (flushed 642 / 702 / 737 / 731), d128 within
# +-3% either way (flushed 674 / 702 / 710 / 704, back to back 612 / 650 / 668 / 666): left off.
HEURISTIC_NC: dict = {128: dict(dynamic=False), 256: dict(dynamic=False, pingpong=False)}
HEURISTIC_NC_MIN_BUCKET = 2048
# tile_overlap (kTileOverlap) in the heuristic: the (head dim, causal) classes whose plain calls take it
# where their config allows it (static persistent, no TMA store), from the seqlen bucket
# HEURISTIC_NC_MIN_BUCKET on. Measured on the H100 (session 16 round B, tests/sm90_fwd_cells_timing.py,
# bf16, x the same tile without it), the first version (S'_0 issued only when a next tile exists):
# d256 full 2k / 4k 0.70 / 0.69, d128 full 2k 0.68 (pingpong 0.59), 16k 0.80 (0.65): correct (bit for
# bit, the GPU test) but ptxas (nvcc 13.0) serialized the kernel's wgmmas ("(C7515) Potential
# Performance Loss ... serialized due to non wgmma instructions defining accumulator registers",
# reported as ptxas *info*, which cuflash.compile.parse_ptxas does not count): the loop's head joined
# the path with S'_0 in flight and the one without. Now the tile loop is rotated (the first tile's S_0
# before the loop; the last tile issues a dropped S GEMM), non-causal only: no C7515
# (tests/test_sm90_tile_overlap_cpu.py). Round D (same script, bf16, x cuDNN, plain tile -> tile_overlap):
# d256 full 2k 1.014 -> 1.005, 4k 1.063 -> 1.064; d128 full 16k 1.064 -> 1.066 (no pingpong), 1.060 ->
# 1.051 (pingpong), 2k (BN 176) 0.984 -> 0.983 / 0.973 -> 0.973; d64 full 2k (the dynamic heuristic 1.047)
# 1.049 / 1.086 with pingpong (one round): level within the rounds' noise (spread 0.1). Empty: off.
HEURISTIC_TILE_OVERLAP: frozenset = frozenset()
# Whether the tuning space has tile_overlap (False, True): off until its GPU test has passed on the H100
# (a tuner verifies every config before timing it, but a kernel that hangs would stop the tune).
TILE_OVERLAP_IN_SPACE = False
SCHED_RING_BYTES = 8 * 4 + 4 * 2
# stream_tail (kStreamTail, kernels_cu/sm90_tail.cuh): the static persistent plain non-causal schedule
# with its last stretch (the last n_tiles - G·(n_tiles // G - 1) tiles on G CTAs) cut by K/V blocks into
# equal ranges, a tile cut in two joined through fp32 partials. The ideal gain is the last wave's idle
# share: 1024 tiles on 132 SMs (every d256 non-causal cell of the benchmark at BM 128, and d128 at 2k:
# 2048 tiles, 15.5 waves) run ceil(7.76) = 8 tiles per CTA where 7.76 would do: 3% (d128 2k: 3%).
# The (head dim, seqlen bucket) classes of plain non-causal calls that take it. Measured on the H100
# (session 17, tests/sm90_fwd_cells_timing.py, dim 2048, batch x seqlen 16k, back to back, samples
# interleaved in shuffled rounds, x SDPA cuDNN of the same rounds; results/NVIDIA_H100_80GB_HBM3/
# stream_tail/), the heuristic's tile -> the same with stream_tail, bf16 (fp16):
#   d128 2k 1.011 -> 1.027 (1.038 -> 1.053), 16k 1.057 -> 1.103 (1.051 -> 1.084);
#   d256 2k 1.013 -> 1.003 (1.007 -> 0.999), 4k 1.040 -> 1.052 (1.042 -> 1.073), 8k 1.115 -> 1.119,
#        16k 1.132 -> 1.147;
#   ncu at locked clocks (one launch): d256 2k 476.0 -> 477.3 us, 4k 869.6 -> 862.6, d128 2k 490.0 -> 482.2.
# d256 2k gains nothing: its pieces are 26 K/V blocks long, and the stretch's extra piece per CTA (a Q
# load, a pipeline fill, the partial's store or merge) costs what the balanced tail saves (ideal 3%).
# The first version (round 1: the schedule in per-thread registers, R2UR before every wgmma) was 10-17%
# slower everywhere. Unmeasured buckets (d128 4k / 8k) and head dims keep the plain schedule. d64 2k
# non-causal, static persistent with stream_tail against the dynamic heuristic: 1.046 -> 1.155 (bf16, one
# round; fp16 and the static tile without stream_tail unmeasured): left off until measured in both dtypes.
HEURISTIC_STREAM_TAIL: frozenset = frozenset({(128, 2048), (128, 16384), (256, 4096), (256, 8192), (256, 16384)})
# lazy_rescale (kLazyRescale, softmax_fold.cuh: FlashAttention-4's, O rescaled only when a row's max moves by more
# than 2^8 in P) on plain calls: the (head dim, causal, seqlen bucket) classes whose tile takes it (non-causal: the
# static persistent one, in place of stream_tail: the two exclude each other; causal: the dynamic one). Applied by
# class_switches to the heuristic's config and to tuned entries' (make: the table's points carry only the space's
# fields), not to a config= given. At d256 the rescale is 128 FMULs per thread and K/V block (a third of the block's
# non-GEMM instructions); on random inputs the max moves past the threshold on no block after the first few.
# Measured (session 22, fwd14, an H200: tests/sm90_fwd_cells_timing.py, dim 2048, batch x seqlen 16k, 30 shuffled
# samples of 10 back-to-back calls, x SDPA cuDNN of the same rounds; results/NVIDIA_H200/logs/
# session22_fwd14/), the tile without -> with it, bf16 (fp16):
#   round 1: d256 2k 1.019 -> 1.048 (1.018 -> 1.045); 4k 1.071 -> 1.103 (1.059 -> 1.089), stream_tail 1.078 (1.073);
#            d128 16k 1.062 -> 1.042 (1.066 -> 1.047): not at d128;
#   round 2: d256 2k 1.024 -> 1.051 (1.009 -> 1.046); 4k 1.070 -> 1.100 (1.054 -> 1.084), stream_tail 1.078 (1.070);
#            8k 1.111 -> 1.137, stream_tail 1.125; 16k 1.122 -> 1.169, stream_tail 1.141; causal 2k (dynamic,
#            pingpong) 1.042 -> 1.094 (1.047 -> 1.098);
#   round 3: d256 2k 1.020 -> 1.049 (1.017 -> 1.046); 4k stream_tail 1.083 -> 1.105 (1.086 -> 1.101); 8k stream_tail
#            1.140 -> 1.150 (1.124 -> 1.143); 16k stream_tail 1.152 -> 1.183 (1.143 -> 1.169); causal 2k 1.042 ->
#            1.094 (1.046 -> 1.094), 4k 1.137 -> 1.207 (1.139 -> 1.204), 8k 1.204 -> 1.289 (1.206 -> 1.292),
#            16k 1.252 -> 1.353 (1.246 -> 1.342).
HEURISTIC_LAZY: frozenset = frozenset({(256, causal, bucket) for causal in (False, True)
                                       for bucket in (2048, 4096, 8192, 16384)})
# pv_overlap (kPvOverlap: the consumers' K/V loop rotated so that ptxas keeps the softmax of S_j above the
# wait for the warpgroup's own P_{j-1} V_{j-1}; without it nvcc 13.0 puts that wait first and the step
# overlaps only the other warpgroups' GEMMs: tests/test_sm90_pv_overlap_cpu.py reads the SASS). Measured
# on the H100 (session 20 round 1, tests/sm90_fwd_cells_timing.py, back to back, 30 shuffled samples, x SDPA
# cuDNN of the same rounds; results/NVIDIA_H100_80GB_HBM3/logs/session20_fwd13/round1.log), the heuristic's
# tile -> the same with pv_overlap: bf16 d256 full 2k 1.010 -> 1.008 (with tile_overlap 1.004 -> 1.014),
# 4k (stream_tail) 1.063 -> 1.039; d128 full 16k 1.113 -> 1.089; d128 causal 8k 1.179 -> 1.160; d64 full
# 4k 1.067 -> 1.051; fp16 d256 full 2k 1.020 -> 1.002. No faster anywhere (the two consumer warpgroups'
# GEMMs already fill the tensor cores under each other's softmax): off, outside the tuning space. The
# (head dim, causal) classes of plain calls that take it: none.
PV_OVERLAP: frozenset = frozenset()
# cluster (kCluster, sm90_fwd_cluster: clusters of 2 CTAs on adjacent Q blocks of one head, each loading half
# of every K_j / V_j by TMA multicast into both: half the K/V bytes through L2). The (head dim, seqlen
# bucket) classes of plain non-causal calls that take it (instead of stream_tail where that is on; for_problem
# drops it where a call's Q blocks per head are odd). Correct (tests/test_sm90_fwd_cluster_gpu.py: bit for bit
# the plain kernel's output; compute-sanitizer synccheck and racecheck clean, tests/sm90_fwd_cluster_sanitize.py)
# but slower everywhere measured: H100, session 20 round 2 (tests/sm90_fwd_cells_timing.py, back to back, 30
# shuffled samples, x SDPA cuDNN of the same rounds; results/NVIDIA_H100_80GB_HBM3/logs/session20_fwd13/
# round2.log), the static persistent tile -> the same in clusters: bf16 d256 full 2k 1.008 -> 0.705, 4k
# 1.051 -> 0.718 (the heuristic, stream_tail, 1.065); d128 full 16k (BN 176, pingpong) 1.110 -> 0.791; fp16
# d256 full 2k 1.000 -> 0.712. Each ring slot's refill now waits for the slower CTA of the pair and a remote
# release, with 2 stages (all d256 fits) too short to hide it (reading; not profiled). None: off, outside the
# tuning space.
HEURISTIC_CLUSTER: frozenset = frozenset()
# The most CTAs a stream_tail launch has (its grid is min(tiles, SMs, this)): the partials' slots, one per
# CTA (an H100 has 132 SMs). Partials per slot: (head_dim / 8 + 1) float4 per consumer thread.
STREAM_TAIL_MAX_CTAS = 144
# Calls with window / softcap / ALiBi (no dropout, fixed lengths): the schedule and softmax
# variants the heuristic gives them, each switched on only by a measurement of
# tests/features_overhead_timing.py (bf16 d128 8k batch 2 x 16 heads, causal and not, against the
# plain call of the same process; results/NVIDIA_H100_80GB_HBM3/features_overhead_timing.json):
#   FEATURE_TILES         {head dim: {feature or "feature:causal" / "feature:full": {field: value}}}:
#                         the tile / schedule fields (BN, persistent, dynamic, tma_store; for a
#                         window alone also q_double, tree_max) of a call
#                         with that feature, over the heuristic's own (a window's entry first, then
#                         softcap's, then ALiBi's: the first feature of the call that has one; a
#                         mask's own entry before the feature's); tma_store only below 16k keys,
#                         as the plain call's
#   FEATURE_LAZY_RESCALE  lazy_rescale (kLazyRescale: O rescaled only when the max moves by > 2^8)
#   SOFTCAP_FOLD          {head dim: fold_cap} with softcap (kFoldCap: 1, one multiply per score
#                         fewer; 2, also the max on the raw scores; 3, a fixed max where the cap
#                         allows it; 2 and 3 with lazy_rescale); a head dim not listed: 0, off
# Measured (H100, x the plain call of the same process, causal / full; fwd, then fwd + bwd):
#   window 1024: static BN 128 1.48 / 1.27 of the visible share -> dynamic + tma_store 1.34 / 1.22
#                (fwd + bwd 1.64 / 1.39 -> 1.62 / 1.37); + lazy_rescale 1.37 / 1.26: off. Session 15
#                round A: 1.33 / 1.20; 3 consumer warpgroups BM 192 BN 64 1.41 / 1.31: off. Round B:
#                BN 64 1.55 / 1.46, one consumer warpgroup at BM 64 2.00 / 1.87: off
#   softcap 30:  BN 176 static 1.47 / 1.46 -> fold_cap 3 + lazy_rescale + dynamic + tma_store at
#                BN 144 1.33 / 1.35 (fwd + bwd 1.27 / 1.23 -> 1.20 / 1.14); fold 1 / 2 slower.
#                Round A: BN 144 1.31 / 1.37 (fwd + bwd 1.22 / 1.20), BN 128 1.28 / 1.40 (1.20 /
#                1.17): causal takes BN 128, full keeps 144 (its forward slower at 128). Round B,
#                fold_cap 4 (Q prescaled by softcap_in: no multiply per score before the tanh):
#                causal BN 128 1.29 -> 1.21 (fwd + bwd 1.22 -> 1.17; BN 144 1.24 / 1.16), full
#                BN 144 1.36 -> 1.28 (1.23 -> 1.17): SOFTCAP_FOLD 4 (fp16 calls take 3: the
#                prescale is bf16 only). Session 18 (tests/softcap_fixed_timing.py, forward only): the
#                fixed max's O normalized by the rounded P's sum (a correctness fix, lr) 1.18 / 1.28 ->
#                1.28 / 1.42; no pingpong, two partial row sums, a tanh-free exponent (ex2 + rcp) and
#                the first block's row max kept were no faster or not exact (CHANGELOG). Session 19
#                (softcap_fixed_timing.py, results/NVIDIA_H100_80GB_HBM3/softcap_session19.md): fold_cap 4
#                refused (its LSE is not the backward's: SOFTCAP_FOLD 3), the rounded sum on the tensor
#                cores: fold 3 1.46 / 1.49 -> 1.38 / 1.45 (fold 4 1.31 / 1.44 -> 1.30 / 1.38); one SFU op
#                per score fewer (timing-only kernels, not the softcap): without the tanh 1.01 / 1.07,
#                without the exp2 1.07 / 1.11; a quarter of the tanhs on the FMA pipes 1.51 / 1.50
#   ALiBi:       causal BN 176 static 1.19 -> dynamic 1.14 (fwd + bwd 1.05 -> 1.04); full 1.11 ->
#                1.12 (fwd + bwd 1.00 -> 1.01). Round A with alibi_lin (ALIBI_LINEAR): causal
#                dynamic 1.13 -> 1.09 (fwd + bwd 1.04 -> 1.03); full static 1.15, dynamic 1.15,
#                static + alibi_lin 1.13, dynamic + alibi_lin 1.11 (fwd + bwd 1.00 / 1.00 / 0.99 /
#                0.99): both masks dynamic with alibi_lin. Session 16 (features_overhead_session16.md),
#                full: BN 160 + TMA store 1.142 / 1.134 against BN 176's 1.152 / 1.147 (rounds A / B):
#                "alibi:full" takes it (causal: that kernel spills 8 bytes, nvcc 13.0); lazy_rescale
#                causal 1.137 / 1.148 against 1.089 / 1.099: off
# (session 14: results/NVIDIA_H100_80GB_HBM3/features_overhead_timing.json; round A of session 15:
# features_overhead_session15.md, rounds A and B.) Other head dims keep the static tiles and fold_cap 0 (unmeasured).
FEATURE_TILES: dict = {128: {"window": dict(persistent=True, dynamic=True, tma_store=True),
                             "softcap:causal": dict(BN=128, persistent=True, dynamic=True, tma_store=True),
                             "softcap": dict(BN=144, persistent=True, dynamic=True, tma_store=True),
                             "alibi:full": dict(BN=160, persistent=True, dynamic=True, tma_store=True),
                             "alibi": dict(persistent=True, dynamic=True)}}
FEATURE_LAZY_RESCALE = False
# tile_overlap for a window alone (fixed lengths), by (kernel head dim, causal, dtype): the schedule fields
# (dynamic, tma_store) that go with it (tma_store below 16k keys only, as the plain call's). A window's tile
# visits few K/V blocks (9 at 1024 and BN 128), so the once-per-tile pipeline fill (the first S with no P V
# beside it, during the last tile's epilogue) weighs ~24% of its forward (features_overhead_session16.md's
# model); kTileOverlap issues the next tile's S_0 behind the last P V. Every tile must have keys: for_bounds
# drops it per call where one has none.
# Measured (session 21, win3, round 1: tests/features_overhead_timing.py --quick --mask both --features window,
# bf16 d128 batch 2 x 16 heads x 8k, window 1024 causal / 1024 x 1024 full, forward x the plain call over the
# visible share; an H200; results/NVIDIA_H200/logs/session21_win3/round1.md), causal / full: the heuristic (dynamic + TMA store)
# 1.338 / 1.213; with tile_overlap 1.328 / 1.230, static + TMA store + tile_overlap 1.311 / 1.175, dynamic +
# two Q buffers 1.323 / 1.235; without the TMA store 1.41-1.44 / 1.23-1.29 (three stages 1.409 / 1.248).
# Round 3 (as shipped; round3.md): static + TMA store + tile_overlap 1.325 / 1.173, the former default 1.338 /
# 1.213, static + TMA store alone 1.314 / 1.192, dynamic + tile_overlap 1.325 / 1.238: static + TMA store +
# tile_overlap on (causal within the noise of static alone; full ahead in both rounds). bf16 only (measured).
WINDOW_TILE_OVERLAP: dict = {(128, True, "bf16"): dict(dynamic=False, tma_store=True),
                             (128, False, "bf16"): dict(dynamic=False, tma_store=True)}
SOFTCAP_FOLD: dict = {128: 3}
# ALiBi's bias as one FFMA per score (alibi_lin, kAlibiLinear) for calls with ALiBi alone (or with a
# window), fixed lengths: the (head dim, causal) classes that take it (measured above).
ALIBI_LINEAR: frozenset = frozenset({(128, True), (128, False)})
# fold_cap's values (4: 3 with Q prescaled by softcap_in in shared memory, bf16 only), and the
# largest cap whose fold_cap 3 / 4 runs the fixed max: P = exp2(k (t - 1))
# with k = softcap·log2(e) stays >= 2^-100 over t in [-1, 1] (2k <= 100), so no visible score's
# P underflows whatever the row's own max (above it the kernel computes the row max, as 2).
FOLD_CAP = (0, 1, 2, 3, 4)
# emu_exp2 with fold_cap (the folded step's exp2s, softmax_fold.cuh): the heuristic's quarters of S's
# tiles on the software exp2 by (head dim, causal) with SOFTCAP_FOLD's fold_cap; 0 where not listed.
# Why again after SOFTCAP_EMU_EXP2's measurement: folded (fold_cap 4, fixed max) a softcapped score
# issues about as many instructions as a plain one (tanh in place of the max), but two SFU ops (tanh,
# exp2) at 16 per SM clock, as long as its share of the two GEMMs at d128 (512 FLOPs at ~4096 per
# clock), where the plain score's one takes half. Measured on the H100 (tests/features_overhead_timing.py,
# session 16 round A, bf16 d128 8k, softcap 30, x the plain forward, causal / full): fold_cap 4 1.203 /
# 1.271, with 1 quarter emulated 1.267 / 1.355, 2 quarters 1.324 / 1.421: off (the kernel pays for every
# issued instruction, ~2% per instruction per score; results/NVIDIA_H100_80GB_HBM3/
# features_overhead_session16.md). Session 19, fold_cap 3 with the row sum on the tensor cores
# (tests/softcap_fixed_timing.py, results/NVIDIA_H100_80GB_HBM3/softcap_session19.md, rounds 2 / 3 / 4):
# emu 1 full (BN 144) 1.445 -> 1.388 / 1.438 -> 1.373 / 1.409 -> 1.360 (emu 2 1.398, BN 128 + emu 1
# 1.511), causal (BN 128) 1.384 -> 1.443 / 1.402 -> 1.438:
# full takes 1, bf16 softcap alone (emu 2 spills 4 bytes at BN 144, nvcc 13.0; BN 160 + emu 1 76).
# Session 21: not under masked_copy (MASKED_COPY's note: with the copy, emu 0 measured faster at full,
# 1.316 -> 1.253), so the shipped heuristic takes it only where MASKED_COPY is 0.
SOFTCAP_FOLD_EMU_EXP2: dict = {(128, False): 1}
FIXED_MAX_LOG2_RANGE = 100.0
# fold_cap 4 (Q prescaled by softcap_in in shared memory, bf16) is refused by the config: its scores
# come from Q·softcap_in rounded to bf16 (2^-9), so the forward's LSE differs from what any backward
# recomputes from the unscaled Q (P = exp(s - LSE) != 1 at one key: dV missed the 3x bound,
# tests/test_softcap_seeds_gpu.py). Making it consistent would need the same rounded Q in the
# backward (a prescale per Q block visit, or a prescaled copy of Q and a dK factor) for the forward's
# one multiply per score. True: allowed, for timing (tests/softcap_fixed_timing.py) only.
FOLD4_TIMING = False
# masked_copy (kMaskedCopy) with fold_cap >= 3 by (head dim, dtype, causal): the folded softcap step's
# masked blocks in a copy of their own, so that an unmasked block's tanhs and exp2s are one basic block
# (without it SASS issues the block's 64 MUFU.TANH in one burst, the mask's branch, then its 64
# MUFU.EX2: the exp2s wait for the last tanh, and the software exp2's FMA work has only the exp2s'
# burst to hide under). 1 copies the fixed-max step, 2 the row-max step too. Measured (session 21,
# tests/softcap_fixed_timing.py, d128 8k, x the plain forward of the same process, on one H200 of a
# 4-GPU host: results/NVIDIA_H200/softcap_session21.md): bf16 cap 30 (fixed max) causal
# 1.405 -> 1.232 (1), full 1.360 -> 1.315 (1, with emu_exp2 1); the row-max copy (2) at bf16 cap 80
# causal 1.435 -> 1.481, full 1.403 -> 1.403, fp16 cap 30 causal 1.380 -> 1.414 / 1.441 -> 1.469,
# full 1.521 -> 1.360 / 1.498 -> 1.344 (two runs). Round 4, the shipped choice against main's kernel in
# one run: bf16 cap 30 causal 1.410 -> 1.228 (1); full 1.372 (emu_exp2 1) -> 1.316 (1, emu 1) and 1.253
# (1, emu 0: with the copy the software exp2 no longer pays, as in round 3, 1.349 -> 1.323: the
# heuristic drops SOFTCAP_FOLD_EMU_EXP2 under the copy); fp16 cap 4 (fixed max) causal 1.404 -> 1.256
# (1), full 1.459 -> 1.327 (2); fp16 cap 30 (row max) full 1.502 -> 1.355 (2), causal 1.447 -> 1.483
# with 2, so causal takes 1 (the row-max step as main's). The row-max step under 1 (bf16 above cap
# 34.7, fp16 causal above 4.85) is main's source; its timing was not compared in one run (bf16 cap 80:
# 1.435 / 1.449 main in rounds 1 / 3, 1.466 with 1 in round 4, causal).
MASKED_COPY: dict = {(128, "bf16", True): 1, (128, "bf16", False): 1, (128, "fp16", True): 1,
                     (128, "fp16", False): 2}
MASKED_COPY_VALUES = (0, 1, 2)
# MASKED_COPY for calls past the fixed max (softcap_fixed_m 2: bf16 caps above 55.45, fp16 above 4.85), by (head
# dim, dtype, causal), where it differs. Measured (session 22, round 2, H200, tests/softcap_fixed_timing.py: bf16 d128
# 8k softcap 50, then on the row max, x plain, 10 interleaved samples; results/NVIDIA_H200/logs/session22_cap9/round2.md), masked_copy
# 1 -> 2: full 1.548 -> 1.363, causal 1.442 -> 1.487 (not taken).
MASKED_COPY_ROW_MAX: dict = {(128, "bf16", False): 2}
# defer_max (kDeferMax) by (head dim, dtype, causal), for calls past the fixed max's range (softcap_fixed_m 2: bf16
# caps above 34.7, fp16 above 4.85; Gemma 2's 50): the row-max step's exp2s from the running max as it was, the
# block's max taken after them (kernels_cu/softmax_fold.cuh softmax_step_deferred). Softcap alone, fold_cap >= 3.
# Measured slower everywhere (session 22, round 2, H200, tests/softcap_fixed_timing.py, d128 8k, x plain; results/NVIDIA_H200/logs/
# session22_cap9/round2.md), the heuristic -> defer_max: bf16 softcap 50 (then on the row max) causal 1.442 -> 1.493,
# full 1.548 -> 1.550; with masked_copy 2 1.628 / 1.561; fp16 softcap 30 1.442 -> 1.470, 1.381 -> 1.550. None.
# s_ahead (kSAhead: S_{j+1} issued before the step of S_j) likewise (round 1, bf16 softcap 30, the heuristic 1.229
# causal / 1.237 full): BN 112 stages 3 1.338 / 1.430, BN 96 1.426 / 1.486, BN 64 stages 4 1.417 / 1.500 (BN 128
# does not fit the registers: ptxas serializes its wgmmas, C7512); and pv_overlap with the folded softcap step
# 1.258 / 1.268 (in SASS its step already runs between the wait for S_j and the wait for P_{j-1} V_{j-1}).
SOFTCAP_DEFER_MAX: frozenset = frozenset()
# fp16 calls: P goes to the P V GEMM as fp16, whose normal range ends at 2^-14, so the fixed max holds
# only where every P = exp2(k (t - 1)) stays a normal fp16 number (2k <= 14: softcap <= 4.85); above it
# the row max (session 17: with the bf16 range, softcap 20 / 30 put every P of random scores near 2^-29
# .. 2^-43, flushed to 0 in fp16: O = 0, the backward's dQ off by up to 1.5; tests/test_bwd_feature_sched_gpu.py)
FIXED_MAX_LOG2_RANGE_FP16 = 14.0
# The fixed max's headroom (session 22): the fixed running max may sit below t's bound 1, at 1 - a / k (k =
# softcap·log2(e), the exponent's scale), so that P = exp2(k (t - m)) spans [2^(a - 2k), 2^a] instead of
# [2^-2k, 1]: with a = 2k - FIXED_MAX_LOG2_RANGE, the bottom stays at 2^-100 (FIXED_MAX_LOG2_RANGE's
# reason) and P's top rises to 2^a. a <= FIXED_MAX_LOG2_TOP: P at most 2^60 goes into the P V GEMM as bf16
# (range 2^127) and O's and l's fp32 sums stay finite while seqlen_k · max|V| < 2^67. bf16 caps up to
# (100 + 60) / (2 log2(e)) = 55.45 then run the fixed max (Gemma 2's 50: a = 44.3) instead of the row max
# (session 22, round 2, H200: bf16 d128 8k, softcap 50 on the row max 1.442 causal / 1.548 full x plain,
# softcap 30 on the fixed max 1.221 / 1.250). fp16: 0 (P itself is fp16 in the GEMM, top 65504).
FIXED_MAX_LOG2_TOP = 60.0
FIXED_MAX_LOG2_TOP_FP16 = 0.0


def softcap_fixed_m(problem: Problem) -> float:
    """params.softcap_fixed_m of a call: the fixed running max in t's units (t = tanh(s·scale / softcap)
    <= 1) where the cap allows one, 1 - a / k with k = softcap·log2(e) and a = max(0, 2k -
    FIXED_MAX_LOG2_RANGE) <= FIXED_MAX_LOG2_TOP (fp16: FIXED_MAX_LOG2_RANGE_FP16, FIXED_MAX_LOG2_TOP_FP16);
    else 2 (the kernel computes the row max); 2 without softcap."""
    cap = problem.softcap if "softcap" in problem.features else 0.0
    fp16 = problem.dtype == "fp16"
    limit = FIXED_MAX_LOG2_RANGE_FP16 if fp16 else FIXED_MAX_LOG2_RANGE
    top = FIXED_MAX_LOG2_TOP_FP16 if fp16 else FIXED_MAX_LOG2_TOP
    k = cap * math.log2(math.e)
    if cap > 0 and 2 * k <= limit:
        return 1.0
    if cap > 0 and 2 * k - limit <= top:
        return 1.0 - (2 * k - limit) / k
    return 2.0


# Variable-length batches (kVarlen): the features that run with varlen, each set's varlen
# instantiations checked to compile without spills at the heuristic's tiles (nvcc 13.0, sm_90a;
# tests/test_sm90_varlen_cpu.py: 168 registers, no spill at d64 and d128, causal and not); any
# other mix (paged) falls back to fa2_fwd. Every subset of window, softcap, ALiBi and dropout: the
# dropout mixes with softcap or ALiBi since session 25 (bwd17: their varlen builds spill nothing at d64
# and d128, causal and not; softcap with dropout also at d128: dropout_mix takes it with varlen). sm90_fwd ranks
# above fa2_fwd (priority): measured faster (bwd17 round 1 on the H100, logs/session25_bwd17/r1/,
# tests/sm90_varlen_bwd_features_timing.py --fwd-features: bf16 d128, 16 heads, 16k tokens of 512..8k, window
# 256, softcap 30, dropout 0.1, x fa2_fwd's time, full / causal): dropout + softcap 0.387 / 0.464, ALiBi +
# dropout 0.497 / 0.400, ALiBi + dropout + softcap 0.583 / 0.467, ALiBi + dropout + window 0.652 / 0.722,
# dropout + softcap + window 0.528 / 0.546, all four 0.679 / 0.748.
VARLEN_FEATURES = ((), ("window",), ("softcap",), ("alibi",), ("dropout",), ("softcap", "window"),
                   ("alibi", "window"), ("alibi", "softcap"), ("alibi", "softcap", "window"),
                   ("dropout", "window"), ("alibi", "dropout"), ("dropout", "softcap"),
                   ("alibi", "dropout", "softcap"), ("alibi", "dropout", "window"),
                   ("dropout", "softcap", "window"), ("alibi", "dropout", "softcap", "window"))
# The heuristic's schedule for varlen: a CTA per tile (the grid is sized for the longest
# sequence; a CTA whose Q block lies past its sequence's end leaves at once). To be measured
# (tests/sm90_varlen_timing.py compares it with the persistent schedule).
VARLEN_PERSISTENT = False


@dataclasses.dataclass(frozen=True, order=True)
class Sm90FwdConfig(KernelConfig):
    """One sm90_fwd kernel.

    BM:        query rows per CTA: 64 per consumer warpgroup
    BN:        keys per K/V block (the N of S = Q Kᵀ): a multiple of 16 in 64..192
    stages:    K/V ring slots in shared memory (>= 2)
    consumers: consumer warpgroups (1, 2 or 3); the CTA has 128 · (consumers + 1) threads
    pingpong:  the consumer warpgroups take turns issuing their GEMMs (needs consumers >= 2)
    persistent: one CTA per SM, each computing a strided share of the tiles (the producer loads
               the next tile while the consumers finish one); else one CTA per tile
    head_dim:  64, 96, 128, 192 or 256 (the compile-time head dim; smaller real ones are zero-filled)
    dtype:     "bf16" or "fp16"
    causal:    bottom-right aligned causal mask, a compile-time flag
    window:    sliding window (kWindow; the bounds are run-time params)
    softcap:   softcapping (kSoftcap; the cap is a run-time param)
    alibi:     ALiBi (kAlibi; the slopes are a run-time pointer)
    dropout:   attention dropout (kDropout: philox.cuh's keep mask, fa2_fwd's bit for bit), set
               from the call (``for_problem``), never tuned; p and the RNG state are run-time
    emu_exp2:  0..4, quarters of S's 8-column tiles whose exp2 runs on the FMA / ALU pipes
               (kEmuExp2, kernels_cu/exp2_emu.cuh) instead of the SFU; 0 is the plain kernel.
               Tuned with softcap only (EMU_EXP2_SPACE); the heuristic keeps 0 (measured:
               SOFTCAP_EMU_EXP2's note)
    dynamic:   the dynamic persistent scheduler (kDynamic; needs persistent): the producer claims
               each next tile from a global counter (heaviest Q blocks first, by sections of
               (head, batch) pairs whose K/V fit in L2: sched_section) and hands it to the
               consumers through shared memory; the counter is the plan's (zeroed once,
               reset by the kernel: ``zeroed_counters``)
    tma_store: O written through shared memory by TMA store (kTmaStore): each consumer warpgroup
               stages its 64 x head_dim tile of O (64 KB per warpgroup at d256) and one thread
               stores it, so the warpgroup goes on to its next tile; needs the staging tile to
               fit shared memory next to Q and the K/V ring
    varlen:    variable-length batches (kVarlen, kernels_cu/varlen.cuh: packed (total, heads, d)
               tensors, per-sequence offsets from cu_seqlens), set from the call (``for_problem``),
               never tuned
    p_smem:    P through shared memory (kPSmem): each consumer warpgroup writes P_j, 16-bit, into
               its own 64 x BN tile of shared memory and O += P V is a wgmma SS, so no register holds
               P's A fragments: three consumer warpgroups fit BN 192 at head dim 64 (FA3's d64 tile,
               MAX_ACCUM_REGS_PSMEM); costs BN x 128 bytes of shared memory per warpgroup. Plain
               calls only (no window, softcap, ALiBi, dropout, varlen)
    tree_max:  the softmax step with shorter dependency chains (kTreeMax, kernels_cu/softmax_tree.cuh:
               the row maxima as pairwise trees, both rows' shuffles together, two partial row sums),
               so that a block's first ex2 issues sooner; not with emu_exp2. Not in the tuning
               space (a heuristic switch: HEURISTIC_D64)
    q_double:  two Q buffers (kQDouble): the producer loads the next tile's Q while the consumers
               still use the current one, so a tile's first GEMM does not wait for Q's load after
               the previous tile's last S (short tiles: d64 at 2k); one more Q block of shared
               memory. Not in the tuning space (a heuristic switch: HEURISTIC_D64)
    lazy_rescale: FlashAttention-4's lazy rescale (kLazyRescale, kernels_cu/softmax_fold.cuh): the
               running max moves only by more than 2^8 in P, and O is rescaled only then; with
               window / softcap / ALiBi (FEATURE_LAZY_RESCALE), not with dropout or emu_exp2; with
               it (or fold_cap) ALiBi's bias comes from fp32 distances (no I2F per score)
    fold_cap:  0..4: softcap folded into the softmax's scale (kFoldCap, softmax_fold.cuh): 1, the
               scores kept as t = tanh(S·scale / softcap) (one multiply fewer per score); 2, also
               the row max taken on the raw S, apart from the tanhs; 3, as 2, but a fixed running
               max (t <= 1) where the cap allows it (softcap_fixed_m: no row max, no O rescale; O
               normalized by the rounded P's row sum, summed on the tensor cores: ones_bytes); 4, as 3
               with Q multiplied by softcap_in in shared memory once per tile (no multiply per
               score before the tanh; bf16 only; refused unless FOLD4_TIMING: its LSE is not the
               backward's).
               2 and 3 act as 1 with ALiBi and need lazy_rescale; needs softcap, not with dropout;
               with emu_exp2 the folded step's exp2s take the software exp2 (SOFTCAP_FOLD,
               SOFTCAP_FOLD_EMU_EXP2)
    alibi_lin: ALiBi's bias as one FFMA per score (kAlibiLinear, softmax_fold.cuh AlibiLinear): the
               per-row part of a linear bias in the softmax's exponent offset; blocks across the
               diagonal (non-causal) take the exact distance. ALiBi alone (no softcap, dropout,
               emu_exp2, varlen, tree_max); ALIBI_LINEAR switches it on per head dim and mask
    rescale_first: O *= alpha_j right after the next S GEMM is issued, before O += P_j V_j
               (kRescaleFirst: FA3's order above head dim 128), so the rescale runs under the S
               GEMM; for tiles without pingpong. Plain calls only (no window, softcap, ALiBi,
               dropout, varlen), not with lazy_rescale / fold_cap / p_smem / tree_max / q_double.
               Measured no faster on the heuristic's non-causal tiles (HEURISTIC_NC's note): off,
               outside the tuning space
    tile_overlap: the next tile's S_0 = Q' K'_0ᵀ issued right behind a tile's last O += P V, so it runs
               during the epilogue (kTileOverlap: the pipeline's fill hidden once per tile; short
               tiles). Non-causal only (every tile has keys: the first tile's S_0 is issued before
               the tile loop, the last tile issues a dropped one, so ptxas sees one S GEMM in flight
               on every path: HEURISTIC_TILE_OVERLAP's note). The static persistent plain kernel
               only (with or without pingpong; no dynamic, varlen, q_double, tma_store, p_smem,
               rescale_first, features). Measured level with the plain tiles (HEURISTIC_TILE_OVERLAP's
               note): off, outside the tuning space. With a window alone also causal, dynamic (the
               next tile taken behind the last P V), tma_store and q_double; every tile must have keys
               (for_bounds drops it per call where one has none); WINDOW_TILE_OVERLAP's classes take it
    drop_packed: dropout's keep mask applied to P's packed 16-bit fragments after the packing
               (kDropPacked, kernels_cu/dropout_packed.cuh: a byte permute and an AND per two
               elements, where the fp32 form compares and selects per element); the same mask and
               bits. Set with dropout by for_problem from DROPOUT_PACKED (by head dim; a config's own
               True kept), never tuned
    drop_early: (drop_packed only) P_j's Philox rounds drawn in the wait for S_j's wgmma, the keep
               flags held and applied after the packing (kDropEarly, dropout_packed.cuh
               draw_keep_flags): 1 as byte signs (a permute and an AND per two elements after the
               packing), 2 as the fragment masks (an AND per two; twice the registers); 4 form 1's
               flags drawn by the producer warpgroup's warps 1-3 into shared memory (gen_bytes; not
               with dynamic or varlen); 0 off. The same mask and bits. Set with drop_packed by for_problem from DROPOUT_EARLY (a config's own
               value kept), never tuned
    stream_tail: the static persistent schedule with a balanced tail (kStreamTail,
               kernels_cu/sm90_tail.cuh): the last stretch of tiles cut by K/V blocks into equal
               ranges per CTA, the tiles cut in two merged through fp32 partials (the plan's zeroed
               buffers, ``zeroed_counters``: per CTA slot (head_dim / 8 + 1) · 16 bytes per consumer
               thread, 19 MB at d256 with 2 consumers); plain non-causal calls, fixed lengths, static
               persistent, not with tile_overlap (HEURISTIC_STREAM_TAIL)
    pv_overlap: the consumers' K/V loop rotated (kPvOverlap, kernels_cu/sm90_fwd_common.cuh kRotate):
               block j's finish (the wait for P_{j-1} V_{j-1}, O's rescale, P_j's packing) at the head of
               the next iteration, so that ptxas keeps the softmax of S_j above that wait: it runs under
               the warpgroup's own P V GEMM (FA3's intra-warpgroup overlap). The same steps in the
               same order; plain calls only (no window, softcap, ALiBi, dropout). Measured no faster
               (PV_OVERLAP's note): off, outside the tuning space
    masked_copy: 0..2: the folded softcap step (fold_cap >= 3, no ALiBi) with the masked blocks in a
               copy of their own (kMaskedCopy), so that an unmasked block's tanhs and exp2s share one
               basic block that ptxas interleaves: 1, the fixed-max step; 2, the row-max step too
               (MASKED_COPY). Outside the tuning space
    s_ahead:   the folded softcap step's S_{j+1} issued before the softmax of S_j, into a second accumulator
               (kSAhead, kernels_cu/sm90_fwd.cu sm90_consume_blocks_ahead); 3 stages and BN <= 112
               (registers). Measured slower (session 22): off, outside the tuning space
    defer_max: the folded softcap row-max step's exp2s from the running max as it was, the block's max
               taken after them (kDeferMax, kernels_cu/softmax_fold.cuh softmax_step_deferred); softcap
               with fold_cap >= 3 and lazy_rescale (SOFTCAP_DEFER_MAX). Outside the tuning space
    cluster:   clusters of 2 CTAs (sm90_fwd_cluster, kCluster): the static persistent grid's CTAs 2c and
               2c + 1 take adjacent Q blocks of one head at every step, and each loads half of every
               K_j's and V_j's column chunks by TMA multicast into both (one L2 read feeds two SMs); a
               ring slot is refilled once both CTAs released it. Non-causal plain fixed-length calls,
               an even number of Q blocks (for_problem drops it otherwise), head dims 96 / 128 / 256;
               not with stream_tail, tile_overlap, q_double. Measured 20-30% slower (HEURISTIC_CLUSTER's
               note): off, outside the tuning space
    rag_keys:  0, or the keys of the ragged last K/V block (a multiple of 16 below BN; -1: the call's,
               seqlen_k % BN where that is a multiple of 16, else 0, set by for_problem): that block (the
               first the loop visits) runs its P V at rag_keys / 16 k16 steps (kRagKeys,
               kernels_cu/sm90_fwd.cu), not over the zero-filled keys' full width. The
               kernel checks per tile that the block holds at most rag_keys keys (else the full width).
               Plain non-causal fixed-length calls; not with tile_overlap, stream_tail, cluster,
               pv_overlap, p_smem (for_problem drops it)
    prefetch:  the producer brings the CTA's next tile's Q into L2 by TMA prefetches once it has issued a
               tile's Q load (kPrefetch, kernels_cu/ptx_sm90_prefetch.cuh), so the next tile's Q load reads
               L2, not DRAM in every SM's burst at the tile switch.
               Static persistent fixed-length calls (not dynamic, stream_tail, cluster, varlen)
    section:   KV heads per section of the dynamic scheduler's tile order (needs dynamic): 0, as many
               as fit SCHED_L2_BYTES of K and V (sched_section); n > 0, n KV heads (1: head-major,
               every CTA of a wave on one KV head's K/V). A run-time param (params.sched_section):
               the kernel, its name expression and its SASS are the same for every value
    even_waves: the static persistent grid sized so that every CTA takes the same number of tiles
               give or take one in the fewest waves (even_waves_grid: 1024 tiles on 132 SMs ->
               128 CTAs of 8 tiles, where 132 CTAs run 100 x 8 + 32 x 7: the same 8 waves, 4 SMs
               idle instead of 32 CTAs idle in the last one). The launch's grid only: the kernel,
               its name expression and its SASS are those of the config without it. Static
               persistent only (no dynamic, stream_tail, cluster)
    """

    BM: int
    BN: int
    stages: int
    consumers: int
    pingpong: bool
    persistent: bool
    head_dim: int
    dtype: str
    causal: bool
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    dropout: bool = False
    emu_exp2: int = 0
    dynamic: bool = False
    tma_store: bool = False
    varlen: bool = False
    p_smem: bool = False
    tree_max: bool = False
    q_double: bool = False
    lazy_rescale: bool = False
    fold_cap: int = 0
    alibi_lin: bool = False
    rescale_first: bool = False
    tile_overlap: bool = False
    drop_packed: bool = False
    drop_early: int = 0
    stream_tail: bool = False
    pv_overlap: bool = False
    cluster: bool = False
    masked_copy: int = 0
    rag_keys: int = 0
    prefetch: bool = False
    s_ahead: bool = False
    defer_max: bool = False
    section: int = 0               # (a run-time param, not a template argument)
    even_waves: bool = False       # (last: the launch's grid, not a template argument)

    family = "sm90_fwd"
    _what = "sm90 forward"

    @property
    def warps(self) -> int:
        return 4 * (self.consumers + 1)

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        return (f"sm90fwd_{self.dtype}_d{self.head_dim}_{mask}_"
                f"BM{self.BM}_BN{self.BN}_s{self.stages}_c{self.consumers}{'_pp' if self.pingpong else ''}"
                f"{'_persist' if self.persistent else ''}{'_dyn' if self.dynamic else ''}"
                f"{'_tmao' if self.tma_store else ''}"
                f"{'_drop' if self.dropout else ''}"
                f"{f'_emu{self.emu_exp2}' if self.emu_exp2 else ''}{'_psmem' if self.p_smem else ''}{'_tree' if self.tree_max else ''}{'_q2' if self.q_double else ''}"
                f"{name_suffix(self)}{'_varlen' if self.varlen else ''}{'_lazy' if self.lazy_rescale else ''}"
                f"{f'_fold{self.fold_cap}' if self.fold_cap else ''}{'_alin' if self.alibi_lin else ''}{f'_sec{self.section}' if self.section else ''}{'_rf' if self.rescale_first else ''}"
                f"{'_tov' if self.tile_overlap else ''}"
                f"{'_dpk' if self.drop_packed else ''}{'_dpe' if self.drop_early == 1 else f'_dpe{self.drop_early}' if self.drop_early else ''}"
                f"{'_st' if self.stream_tail else ''}{'_pvo' if self.pv_overlap else ''}{'_cl2' if self.cluster else ''}"
                f"{f'_mcp{self.masked_copy}' if self.masked_copy else ''}{f'_rag{self.rag_keys}' if self.rag_keys else ''}"
                f"{'_pf' if self.prefetch else ''}{'_sah' if self.s_ahead else ''}{'_dmx' if self.defer_max else ''}"
                f"{'_ev' if self.even_waves else ''}")

    @property
    def smem_cols(self) -> int:
        """Columns a shared-memory tile row holds: whole 64-column swizzle chunks (d96: 128,
        the last 32 zeros; the kernel's kChunks * 64)."""
        return -(-self.head_dim // 64) * 64

    @property
    def smem_bytes(self) -> int:
        """Q, stages x (K, V), the mbarriers (Q full and empty; K/V full and empty per slot),
        and 1024 bytes to align the base (as the kernel's Sm90FwdShape::kSmemBytes)."""
        return ((self.BM + 2 * self.stages * self.BN) * self.smem_cols * 2 + 8 * (2 + 4 * self.stages)
                + (SCHED_RING_BYTES if self.dynamic else 0) + self.o_stage_bytes + self.p_tile_bytes
                + (self.BM * self.smem_cols * 2 + 16 if self.q_double else 0) + self.gen_bytes + self.ones_bytes
                + 1024)

    @property
    def ones_bytes(self) -> int:
        """fold_cap 3 / 4 without ALiBi: the block of ones of the row sum on the tensor cores (kernel:
        Sm90FwdShape kOnesRegion, ptx_sm90_rowsum.cuh kOnesBytes); 0 otherwise."""
        return 256 if self.fold_cap >= 3 and not self.alibi else 0

    @property
    def gen_bytes(self) -> int:
        """drop_early 4's drawn keep flags (16 bytes per consumer thread and 32-key block), their
        mbarriers (2 per consumer warpgroup) and 16 bytes of alignment (kernel: Sm90FwdShape
        kGenAllBytes); 0 otherwise."""
        return self.consumers * 128 * (self.BN // 32) * 16 + 16 * self.consumers + 16 if self.drop_early == 4 else 0

    @property
    def o_stage_bytes(self) -> int:
        """tma_store's staging tiles of O: per consumer warpgroup 64 rows x smem_cols (kernel:
        Sm90FwdShape::kOStageBytes); 0 without it."""
        return self.consumers * 64 * self.smem_cols * 2 if self.tma_store else 0

    @property
    def p_tile_bytes(self) -> int:
        """p_smem's P tiles: per consumer warpgroup 64 rows x ceil(BN / 64) 64-key chunks of 16-bit
        (kernel: Sm90FwdShape::kPBytes); 0 without it."""
        return self.consumers * 64 * -(-self.BN // 64) * 64 * 2 if self.p_smem else 0

    @property
    def accum_regs(self) -> int:
        """fp32 accumulator registers per consumer thread: O (64 x head_dim) and S (64 x BN);
        d96 holds 96 columns of O (48 registers), not d128's 128."""
        return (self.head_dim + self.BN) // 2

    @property
    def dropout_bn_max(self) -> int:
        """The widest BN of a dropout kernel at this head dim (DROPOUT_BN, or with drop_packed
        DROPOUT_PACKED_BN where it lists the head dim)."""
        bn = DROPOUT_BN.get(self.head_dim, 0)
        return DROPOUT_PACKED_BN.get(self.head_dim, bn) if self.drop_packed else bn

    def kernel_name(self) -> str:
        # the trailing template parameters are written only up to the last one set, so a plain
        # config's name (the compile cache's key) is what it was before they existed
        tail = [f"{'true' if self.dropout else 'false'}", f"{self.emu_exp2}",   # kDropout, kEmuExp2
                f"{'true' if self.dynamic else 'false'}",                         # kDynamic
                f"{'true' if self.tma_store else 'false'}",                       # kTmaStore
                f"{'true' if self.varlen else 'false'}",                          # kVarlen
                f"{'true' if self.p_smem else 'false'}",                          # kPSmem
                f"{'true' if self.tree_max else 'false'}",                        # kTreeMax
                f"{'true' if self.q_double else 'false'}",                        # kQDouble
                f"{'true' if self.lazy_rescale else 'false'}",                    # kLazyRescale
                f"{self.fold_cap}",                                               # kFoldCap
                f"{'true' if self.alibi_lin else 'false'}",                       # kAlibiLinear
                f"{'true' if self.rescale_first else 'false'}",                   # kRescaleFirst
                f"{'true' if self.tile_overlap else 'false'}",                    # kTileOverlap
                f"{'true' if self.drop_packed else 'false'}",                     # kDropPacked
                f"{int(self.drop_early)}",                                        # kDropEarly
                f"{'true' if self.stream_tail else 'false'}",                     # kStreamTail
                f"{'true' if self.pv_overlap else 'false'}",                      # kPvOverlap
                f"{self.masked_copy}",                                            # kMaskedCopy
                f"{self.rag_keys}",                                               # kRagKeys
                f"{'true' if self.prefetch else 'false'}",                        # kPrefetch
                f"{'true' if self.s_ahead else 'false'}",                         # kSAhead
                f"{'true' if self.defer_max else 'false'}"]                       # kDeferMax last
        used = (22 if self.defer_max else 21 if self.s_ahead else 20 if self.prefetch else 19 if self.rag_keys else 18 if self.masked_copy else 17 if self.pv_overlap else 16 if self.stream_tail else 15 if self.drop_early else 14 if self.drop_packed else 13 if self.tile_overlap else 12 if self.rescale_first else 11 if self.alibi_lin else 10 if self.fold_cap else 9 if self.lazy_rescale else 8 if self.q_double else
                7 if self.tree_max else 6 if self.p_smem else 5 if self.varlen else
                4 if self.tma_store else 3 if self.dynamic else
                2 if self.emu_exp2 else 1 if self.dropout else 0)
        # cluster: sm90_fwd_cluster, its cluster size (2) first, then every argument of sm90_fwd
        entry = "sm90_fwd_cluster<2, " if self.cluster else "sm90_fwd<"
        return (f"cuflash::{entry}{self.BM}, {self.BN}, {self.stages}, {self.consumers}, "
                f"{'true' if self.pingpong else 'false'}, {'true' if self.persistent else 'false'}, "
                f"{self.head_dim}, cuflash::{self.dtype}, "
                f"{'true' if self.causal else 'false'}{template_suffix(self)}"
                f"{''.join(', ' + a for a in tail[:used])}>")

    def template_args(self) -> tuple:
        if self.cluster:   # (sm90_fwd_cluster's leading cluster size)
            return (2,) + self.replace(cluster=False).template_args()
        return (self.BM, self.BN, self.stages, self.consumers, self.pingpong, self.persistent,
                self.head_dim, self.dtype, self.causal, self.window, self.softcap, self.alibi,
                self.dropout, self.emu_exp2, self.dynamic, self.tma_store, self.varlen, self.p_smem,
                self.tree_max, self.q_double, self.lazy_rescale, self.fold_cap, self.alibi_lin,
                self.rescale_first, self.tile_overlap, self.drop_packed, int(self.drop_early), self.stream_tail,
                self.pv_overlap, self.masked_copy, self.rag_keys, self.prefetch, self.s_ahead, self.defer_max)

    def softcap_overlap_ok(self) -> bool:
        """pv_overlap's rotated loop around the folded softcap step (fold_cap >= 3, softcap alone):
        the one feature step it is allowed with (SOFTCAP_PV_OVERLAP)."""
        return (self.softcap and self.fold_cap >= 3 and not (self.window or self.alibi or self.dropout
                                                             or self.alibi_lin))

    def _problems(self) -> list[str]:
        out = []
        if self.head_dim not in HEAD_DIMS:
            out.append(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if self.consumers not in (1, 2, 3):
            out.append(f"consumers must be 1, 2 or 3, got {self.consumers}")
        elif self.BM != 64 * self.consumers:
            out.append(f"BM={self.BM} must be 64 * consumers = {64 * self.consumers} "
                       "(each consumer warpgroup owns 64 query rows)")
        if self.BN % 16 or not 64 <= self.BN <= 192:
            out.append(f"BN must be a multiple of 16 in 64..192 (wgmma n; P's k16 steps), got {self.BN}")
        if self.pingpong and self.consumers == 1:
            out.append(f"pingpong needs 2 or 3 consumer warpgroups, got {self.consumers}")
        if self.stages < 2:
            out.append(f"stages must be >= 2, got {self.stages}")
        if self.dropout and self.BN % 32:
            out.append(f"dropout needs BN a multiple of 32 (one Philox call covers 32 keys, "
                       f"philox.cuh), got {self.BN}")
        elif self.dropout and self.head_dim in DROPOUT_BN and self.BN > self.dropout_bn_max:
            out.append(f"dropout at BN={self.BN}: the Philox rounds spill above "
                       f"BN={self.dropout_bn_max} at head_dim={self.head_dim} "
                       f"({'DROPOUT_PACKED_BN' if self.drop_packed else 'DROPOUT_BN'})")
        if self.emu_exp2 not in EMU_EXP2:
            out.append(f"emu_exp2 must be one of {EMU_EXP2} (quarters of S's 8-column tiles), "
                       f"got {self.emu_exp2}")
        elif self.emu_exp2 and not self.softcap:
            out.append(f"emu_exp2={self.emu_exp2} needs softcap (without it the SFU is not the "
                       f"bottleneck: measured slower at every fraction, SOFTCAP_EMU_EXP2's note)")
        elif self.emu_exp2 and self.dropout:
            out.append(f"emu_exp2={self.emu_exp2} with dropout is not implemented (its registers "
                       "are unchecked)")
        if self.dynamic and not self.persistent:
            out.append("dynamic (the dynamic scheduler) needs persistent: its CTAs claim tiles "
                       "on a grid of one CTA per SM")
        if self.varlen and (self.dynamic or self.tma_store):
            out.append("varlen with dynamic / tma_store: a varlen CTA skips tiles past its sequence's "
                       "end, which the dynamic scheduler's turn count does not allow for, and a TMA "
                       "store would write a box's rows past the sequence's end into the next one's")
        if self.tree_max and self.emu_exp2:
            out.append(f"tree_max with emu_exp2={self.emu_exp2}: the software exp2's step has no "
                       "tree variant")
        if self.p_smem and self.consumers != 3:
            out.append(f"p_smem needs 3 consumer warpgroups, got {self.consumers} (with fewer, the "
                       "registers hold P's fragments next to any tile that fits shared memory)")
        if self.p_smem and (self.window or self.softcap or self.alibi or self.dropout or self.varlen):
            out.append("p_smem with window / softcap / ALiBi / dropout / varlen is not implemented "
                       "(those instantiations are unchecked for registers)")
        if self.fold_cap not in FOLD_CAP:
            out.append(f"fold_cap must be one of {FOLD_CAP}, got {self.fold_cap}")
        elif self.fold_cap and not self.softcap:
            out.append("fold_cap folds the softcap into the softmax's scale: it needs softcap")
        elif self.fold_cap == 4 and self.dtype != "bf16":
            out.append("fold_cap=4 prescales Q by softcap_in in 16-bit: bf16 only (fp16's products of "
                       "small entries fall to subnormals)")
        elif self.fold_cap >= 2 and not self.lazy_rescale:
            out.append(f"fold_cap={self.fold_cap} needs lazy_rescale (without it ptxas, nvcc 13.0, "
                       "spilled ~300 bytes at BN 176)")
        if self.fold_cap == 4 and not FOLD4_TIMING:
            out.append("fold_cap=4 computes the scores from Q·softcap_in rounded to bf16, so the forward's "
                       "LSE is not the one of the scores every backward recomputes from Q (dV off at one "
                       "key): refused (sm90_fwd.FOLD4_TIMING allows it for timing)")
        if (self.lazy_rescale or self.fold_cap) and (self.dropout or (self.emu_exp2 and not self.fold_cap)):
            out.append("lazy_rescale / fold_cap run without dropout, and emu_exp2 only with fold_cap "
                       "(kernels_cu/softmax_fold.cuh)")
        if self.s_ahead and not (self.softcap_overlap_ok() and not (self.tile_overlap or self.pv_overlap or self.p_smem
                                                                    or self.rescale_first or self.stream_tail
                                                                    or self.cluster)):
            out.append("s_ahead issues S_{j+1} before the folded softcap step of S_j (kSAhead): softcap alone with "
                       "fold_cap >= 3, not with tile_overlap, pv_overlap, p_smem, rescale_first, stream_tail or "
                       "cluster")
        if self.defer_max and not (self.softcap and self.fold_cap >= 3 and self.lazy_rescale
                                   and not (self.alibi or self.dropout or self.stream_tail)):
            out.append("defer_max defers the folded softcap step's row max (kDeferMax): softcap with fold_cap >= 3 "
                       "and lazy_rescale, not with ALiBi, dropout or stream_tail")
        if self.masked_copy not in MASKED_COPY_VALUES:
            out.append(f"masked_copy must be one of {MASKED_COPY_VALUES}, got {self.masked_copy}")
        elif self.masked_copy and (self.fold_cap < 3 or self.alibi):
            out.append("masked_copy copies the folded softcap step: it needs fold_cap >= 3 and no ALiBi "
                       "(kMaskedCopy, kernels_cu/sm90_fwd.cu)")
        if (self.lazy_rescale or self.fold_cap) and (self.p_smem or self.tree_max or self.q_double):
            out.append("lazy_rescale / fold_cap with p_smem / tree_max / q_double: not designed together "
                       "(the feature variants' softmax step and the d64 plain-call options were written "
                       "apart; the combined instantiations are unchecked for registers and results)")
        if self.alibi_lin and (not self.alibi or self.softcap or self.dropout or self.emu_exp2
                               or self.varlen or self.tree_max or self.p_smem):
            out.append("alibi_lin is ALiBi's bias alone: it needs alibi, and not softcap, dropout, "
                       "emu_exp2, varlen, tree_max or p_smem (kAlibiLinear, softmax_fold.cuh)")
        if self.rescale_first and (self.lazy_rescale or self.fold_cap or self.p_smem or self.tree_max
                                   or self.q_double):
            out.append("rescale_first with lazy_rescale / fold_cap / p_smem / tree_max / q_double: not "
                       "designed together (unchecked for registers and results)")
        if self.rescale_first and (self.window or self.softcap or self.alibi or self.dropout or self.varlen):
            out.append("rescale_first with window / softcap / ALiBi / dropout / varlen is not implemented "
                       "(those instantiations are unchecked for registers)")
        # (a window's tile_overlap: persistent, static or dynamic, with or without the TMA store, causal
        # or not; every tile must have keys, which the call's run-time bounds decide: for_bounds)
        if self.tile_overlap and not (self.persistent and (self.window or not self.dynamic)):
            out.append("tile_overlap needs the static persistent schedule (the next tile is tile + grid "
                       "size; the dynamic scheduler's is not known that early), or with a window the "
                       "persistent one, static or dynamic (the next tile taken behind the last P V)")
        if self.tile_overlap and self.causal and not self.window:
            out.append("tile_overlap is non-causal only (every tile must have keys: its S_0 is issued "
                       "before the tile starts), or causal with a window (for_bounds checks the keys)")
        if self.tile_overlap and (self.varlen or ((self.q_double or self.tma_store) and not self.window)
                                  or self.p_smem or self.rescale_first):
            out.append("tile_overlap with varlen / q_double or tma_store (but with a window) / p_smem / "
                       "rescale_first: not designed together (kTileOverlap's static_assert)")
        if self.tile_overlap and (self.softcap or self.alibi or self.dropout or self.emu_exp2
                                  or self.lazy_rescale or self.fold_cap):
            out.append("tile_overlap with softcap / ALiBi / dropout (or their softmax variants) "
                       "is not implemented: plain calls only (or a window alone)")
        if self.drop_early not in (0, 1, 2, 4) and not (self.drop_early in (3, 5, 6) and DROP_EARLY_TIMING):
            out.append(f"drop_early must be 0 (off), 1 (byte signs), 2 (fragment masks) or 4 (drawn by the "
                       f"producer warpgroup), got {self.drop_early} (3, 5, 6: timing forms, not the mask: "
                       "DROP_EARLY_TIMING)")
        if self.drop_early == 4 and (self.dynamic or self.varlen or self.causal or self.window
                                     or self.consumers != 2):
            out.append("drop_early 4 (the producer warpgroup draws the keep flags): the static tile order "
                       "only (not with dynamic or varlen), 2 consumer warpgroups, no causal / window mask "
                       "(the causal kernel spilled 4 bytes in the drawing loop, nvcc 13.0)")
        if self.drop_early in (1, 3, 4, 5) and self.BN > DROP_EARLY_SIGNS_BN:
            out.append(f"drop_early 1 (byte signs) at BN={self.BN}: checked up to BN {DROP_EARLY_SIGNS_BN} "
                       "(no spills, nvcc 13.0)")
        if self.drop_early == 2 and self.BN > DROP_EARLY_MASKS_BN:
            out.append(f"drop_early 2 (fragment masks, BN / 4 registers held across the softmax) at "
                       f"BN={self.BN}: ptxas spills above BN {DROP_EARLY_MASKS_BN} (nvcc 13.0)")
        if self.drop_early and not self.drop_packed:
            out.append("drop_early applies its keep flags to P's packed fragments (kDropEarly): it "
                       "needs drop_packed")
        if self.drop_packed and (not self.dropout or self.p_smem):
            out.append("drop_packed applies dropout's keep mask to P's packed fragments in registers "
                       "(kDropPacked): it needs dropout, and not p_smem")
        if self.stream_tail and not (self.persistent and not self.dynamic):
            out.append("stream_tail needs the static persistent schedule (its pieces are fixed per CTA)")
        if self.stream_tail and self.pingpong and self.head_dim == 256:
            out.append("stream_tail with pingpong at head_dim=256 spills 8 bytes (ptxas, nvcc 13.0); the d256 "
                       "tiles run without pingpong")
        if self.stream_tail and (self.causal or self.varlen or self.tile_overlap):
            out.append("stream_tail is for non-causal fixed-length calls without tile_overlap (every tile "
                       "must have the same K/V blocks: kernels_cu/sm90_tail.cuh)")
        if self.cluster and not (self.persistent and not self.dynamic):
            out.append("cluster needs the static persistent schedule (both CTAs of a cluster walk adjacent Q "
                       "blocks of the same heads: tile + grid, the grid even)")
        if self.cluster and (self.causal or self.varlen or self.stream_tail or self.tile_overlap or self.q_double):
            out.append("cluster is for non-causal fixed-length calls without stream_tail, tile_overlap or "
                       "q_double (both CTAs of a cluster must load the same K/V blocks)")
        if self.cluster and self.smem_cols // 64 % 2:
            out.append(f"cluster at head_dim={self.head_dim}: each CTA loads half of a K/V tile's 64-column "
                       "chunks, which must be even (head dims 96, 128, 256)")
        if self.window or self.softcap or self.alibi or self.dropout or self.emu_exp2 or self.lazy_rescale \
                or self.fold_cap or self.alibi_lin:
            for flag in ("stream_tail", "cluster", "pv_overlap"):   # schedules built for plain calls
                if flag == "pv_overlap" and self.softcap_overlap_ok():
                    continue   # (and the folded softcap step's: SOFTCAP_PV_OVERLAP)
                if getattr(self, flag):
                    out.append(f"{flag} with window / softcap / ALiBi / dropout (or their softmax variants) "
                               "is not implemented: plain calls only")
        if self.rag_keys not in (-1, 0) and (self.rag_keys % 16 or not 0 < self.rag_keys < self.BN):
            out.append(f"rag_keys must be 0, -1 (the call's) or a multiple of 16 below BN={self.BN}, got {self.rag_keys}")
        if self.rag_keys and (self.causal or self.window or self.softcap or self.alibi or self.dropout or self.varlen
                              or self.tile_overlap or self.stream_tail or self.cluster or self.pv_overlap
                              or self.p_smem or self.fold_cap or self.emu_exp2):
            out.append("rag_keys narrows the ragged last K/V block of plain non-causal fixed-length calls: not with "
                       "causal / window / softcap / ALiBi / dropout / varlen, tile_overlap, stream_tail, cluster, "
                       "pv_overlap, p_smem (kRagKeys' static_assert)")
        if self.prefetch and not (self.persistent and not self.dynamic and not self.stream_tail and not self.cluster
                                  and not self.varlen):
            out.append("prefetch needs the static persistent schedule (the next tile is tile + grid size), fixed "
                       "lengths: not dynamic, stream_tail, cluster or varlen")
        if self.even_waves and not (self.persistent and not self.dynamic and not self.stream_tail
                                    and not self.cluster):
            out.append("even_waves sizes the static persistent grid: it needs persistent, and not dynamic, "
                       "stream_tail or cluster (their grids are their own)")
        if self.section < 0 or self.section > MAX_SECTION:
            out.append(f"section must be 0 (the L2 rule) or 1..{MAX_SECTION} KV heads, got {self.section}")
        elif self.section and not self.dynamic:
            out.append(f"section={self.section} orders the dynamic scheduler's tiles: it needs dynamic")
        if not out and self.smem_bytes > MAX_SMEM:
            out.append(f"needs {self.smem_bytes} bytes of shared memory, more than the "
                       f"{MAX_SMEM} an sm_90 CTA can have")
        if self.p_smem and self.tma_store and self.consumers == 3:
            out.append("p_smem with tma_store and 3 consumer warpgroups spills (ptxas, nvcc 13.0)")
        elif (self.tma_store and self.consumers == 3 and self.head_dim in HEAD_DIMS
              and self.accum_regs + self.BN // 4 > TMA_STORE_C3_REGS):
            out.append(f"tma_store with 3 consumer warpgroups and {self.accum_regs} accumulator + "
                       f"{self.BN // 4} P registers per thread spills (ptxas, nvcc 13.0): at most "
                       f"{TMA_STORE_C3_REGS} together")
        budget = (MAX_ACCUM_REGS if not self.p_smem else MAX_ACCUM_REGS_PSMEM_MASKED
                  if self.causal else MAX_ACCUM_REGS_PSMEM).get(self.consumers, 0)
        if not out and self.accum_regs > budget:
            out.append(f"{self.accum_regs} fp32 accumulator registers per consumer thread (O and S) "
                       f"exceed the budget of {budget} with {self.consumers} consumer warpgroup(s)"
                       f"{' and P in shared memory' if self.p_smem else ''}: it would spill")
        return out


# ---------------------------------------------------------------------------------------
# TMA tensor maps (cuTensorMapEncodeTiled through ctypes)

CU_TENSOR_MAP_DATA_TYPE = {"fp16": 6, "bf16": 9}
SWIZZLE_128B = 3
L2_PROMOTION_128B = 2
OOB_FILL_ZEROS = 0
BOX_COLS = 64                  # 128 bytes of 16-bit elements: the 128B swizzle's span


@functools.lru_cache(maxsize=1)
def _cu_encode():
    """cuTensorMapEncodeTiled from the driver (loaded on first use, not at import)."""
    from ..launch import libcuda

    fn = libcuda().cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p,
                   u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def encode_tiled(dtype_code: int, ptr: int, dims, strides_bytes, box, swizzle, l2, oob) -> bytes:
    """One CUtensorMap (128 bytes). dims innermost first; strides_bytes of dims 1.. (rank - 1)."""
    rank = len(dims)
    holder = ctypes.create_string_buffer(128 + 64)           # the map must be 64-byte aligned
    addr = (ctypes.addressof(holder) + 63) & ~63
    res = _cu_encode()(addr, dtype_code, rank, ptr, (ctypes.c_uint64 * rank)(*dims),
                       (ctypes.c_uint64 * (rank - 1))(*strides_bytes), (ctypes.c_uint32 * rank)(*box),
                       (ctypes.c_uint32 * rank)(*([1] * rank)), 0, swizzle, l2, oob)
    if res != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {res}): dims {dims}, "
                           f"strides {strides_bytes} bytes, box {box}, address {ptr:#x}")
    return ctypes.string_at(addr, 128)


_encoder = encode_tiled        # tests swap in a fake (no driver needed)


def tensor_map_args(dtype: str, ptr: int, shape, strides, rows: int) -> tuple:
    """The cuTensorMapEncodeTiled arguments of one (batch, seqlen, heads, head_dim) tensor:
    rank 4, innermost first (head_dim, seqlen, heads, batch), the caller's strides in bytes,
    box BOX_COLS x rows x 1 x 1, 128B swizzle, out-of-bounds zero fill. A dimension of extent 1
    may have any stride (the API accepts it): it gets 16 bytes, which TMA accepts and never
    multiplies by a non-zero coordinate."""
    batch, seqlen, heads, head_dim = shape
    dims = (head_dim, seqlen, heads, batch)
    strides_bytes = tuple(2 * s if n > 1 else 16 for s, n in
                          ((strides[1], seqlen), (strides[2], heads), (strides[0], batch)))
    return (CU_TENSOR_MAP_DATA_TYPE[dtype], ptr, dims, strides_bytes, (BOX_COLS, rows, 1, 1),
            SWIZZLE_128B, L2_PROMOTION_128B, OOB_FILL_ZEROS)


_MAP_CACHE: dict = {}
_MAP_CACHE_MAX = 4096


def tensor_map(dtype: str, ptr: int, shape, strides, rows: int) -> bytes:
    """The encoded map, cached per (dtype, pointer, shape, strides, box rows)."""
    key = (dtype, ptr, tuple(shape), tuple(strides), rows)
    blob = _MAP_CACHE.get(key)
    if blob is None:
        if len(_MAP_CACHE) >= _MAP_CACHE_MAX:
            _MAP_CACHE.clear()
        blob = _MAP_CACHE[key] = _encoder(*tensor_map_args(dtype, ptr, shape, strides, rows))
    return blob


def map_shapes(problem: Problem, strides: dict) -> dict:
    """The (batch, seqlen, heads, head_dim) extents of the q, k, v tensor maps. varlen: the
    packed (total, heads, head_dim) tensors as one batch of the token totals
    (``strides["totals"]``), so a box starts at any packed row (kernels_cu/sm90_fwd.cu, kVarlen:
    TMA zero-fills only past the packed end, the kernel masks the rest)."""
    p = problem
    if is_varlen(p):
        total_q, total_k = (int(t) for t in strides["totals"])
        return {"q": (1, total_q, p.nheads, p.head_dim), "k": (1, total_k, p.nheads_kv, p.head_dim),
                "v": (1, total_k, p.nheads_kv, p.head_dim)}
    return {"q": (p.batch, p.seqlen_q, p.nheads, p.head_dim),
            "k": (p.batch, p.seqlen_k, p.nheads_kv, p.head_dim),
            "v": (p.batch, p.seqlen_k, p.nheads_kv, p.head_dim)}


def window_tiles(head_dim: int) -> tuple:
    """(BN, persistent) for a sliding-window forward (BM = 128), from the block counts of
    results/NVIDIA_H100_80GB_HBM3/features_window_analysis.md (cuflash.band mirrors the kernel's
    block ranges):
    * BN divides BM (128 up to head dim 128, else 64, where 128 would not fit the registers or
      shared memory): with window bounds that are multiples of BN (1024, 4096, ...) the band's
      edges fall on block boundaries, so a Q block visits (BM + left + right) / BN blocks and
      fewer of them need the element-wise mask. Window 1024 causal at 8k: 1.12x the visible
      elements computed and 22% of the visited blocks masked at BN 128, 1.28x and 39% at the
      plain heuristic's BN 176.
    * persistent: a windowed Q block runs a short loop of equal length (9 K/V blocks there,
      against 24 on average for the causal call), so the per-tile start (Q and first K/V loads,
      the first S without a P V to overlap) weighs more; the persistent schedule loads the next
      tile while the consumers finish the last one.
    Depends only on the head dim, so the choice cache (keyed by the problem class, not the
    window's run-time bounds) stays right."""
    return (128 if head_dim <= 128 else 64), True


def tile_overlap_fits(config, problem: Problem) -> bool:
    """Whether every tile of ``problem`` (fixed lengths; its window bounds) visits a K/V block at
    ``config``'s BM, BN: tile_overlap's rule (kernels_cu/sm90_fwd.cu kTileOverlap)."""
    from ..band import Band, every_q_block_has_keys

    if is_varlen(problem):
        return False
    window = tuple(problem.window) if "window" in problem.features else (-1, -1)
    return every_q_block_has_keys(Band(problem.seqlen_q, problem.seqlen_k, bool(problem.causal), window),
                                  config.BM, config.BN)


def feature_tiles(problem: Problem, head_dim: int) -> dict:
    """FEATURE_TILES' fields for a call with features at compile-time head dim ``head_dim``: the
    entry of its first feature in the order window, softcap, ALiBi that has one (the mask's own
    entry, "feature:causal" or "feature:full", before the feature's), else {}."""
    by_feature = FEATURE_TILES.get(head_dim, {})
    mask = "causal" if problem.causal else "full"
    for f in ("window", "softcap", "alibi"):
        if f in problem.features:
            for key in (f"{f}:{mask}", f):
                if key in by_feature:
                    return dict(by_feature[key])
    return {}


def sched_section(problem: Problem, kv_heads: int = 0) -> int:
    """(head, batch) pairs per section of the dynamic scheduler's tile order (kernels_cu/sm90_fwd.cu,
    sm90_sectioned_tile): ``kv_heads`` KV heads (the config's ``section``) or, 0, as many as fit
    SCHED_L2_BYTES of K and V, rounded down to a power of two; times the query heads per KV head
    (a section starts on a KV head's first query head), at least one KV head's, at most every
    pair."""
    if kv_heads <= 0:
        kv_bytes = max(1, problem.seqlen_k) * problem.head_dim * 2 * 2
        kv_heads = 1 << (SCHED_L2_BYTES // kv_bytes).bit_length() - 1 if kv_bytes <= SCHED_L2_BYTES else 1
    group = problem.nheads // max(1, problem.nheads_kv)
    return max(1, min(kv_heads * group, problem.nheads * problem.batch))


def stream_tail_buffers(config, tiles: int = STREAM_TAIL_MAX_CTAS) -> dict:
    """{params field: int32 count} of stream_tail's buffers (kernels_cu/sm90_tail.cuh): a flag per (slot,
    consumer thread) and the fp32 partials, (head_dim / 8 + 1) float4 per (slot, consumer thread); a
    slot per CTA: at most one per tile and STREAM_TAIL_MAX_CTAS (the grid, stream_tail_grid, whatever
    the GPU's SM count)."""
    threads = 128 * config.consumers
    slots = max(1, min(tiles, STREAM_TAIL_MAX_CTAS))
    return {"tail_flags": slots * threads, "tail_partial": slots * (config.head_dim // 8 + 1) * threads * 4}


def stream_tail_grid(tiles: int, sm_count: int) -> int:
    """The persistent grid of a stream_tail launch: a CTA per SM, at most one per tile and
    STREAM_TAIL_MAX_CTAS (the partials' slots)."""
    return max(1, min(tiles, sm_count, STREAM_TAIL_MAX_CTAS))


def even_waves_grid(tiles: int, sm_count: int) -> int:
    """even_waves' static persistent grid: the fewest CTAs that still finish ``tiles`` in the waves
    of a CTA per SM (ceil(tiles / sm_count)), so every CTA takes that many tiles or one fewer: 1024 tiles
    on 132 SMs, 128 CTAs of 8 (not 100 of 8 and 32 of 7)."""
    waves = -(-tiles // max(1, sm_count))
    return max(1, -(-tiles // max(1, waves)))


def stream_tail_params(n_tiles: int, n: int, grid: int) -> dict:
    """params.tail_* of a stream_tail launch (kernels_cu/sm90_tail.cuh Sm90TailSchedule): the K/V blocks
    per tile n, the data-parallel tiles, the stretch's units per range (q, and one more for the first
    rem ranges) and the magic multiplier and shift of the division by n, so that the kernel's
    schedule needs no division (which would move it out of the uniform registers)."""
    waves = n_tiles // grid
    dp_end = n_tiles if n == 0 else grid * (waves - 1)
    units = (n_tiles - dp_end) * n
    if units >= 2 ** 31:
        raise ValueError(f"stream_tail: {units} (tile, K/V block) units in the last stretch, more than the "
                         "kernel's 32-bit schedule counts (2^31)")
    magic = shift = 0
    if n:
        shift = 31 + (n - 1).bit_length()
        magic = -(-(1 << shift) // n)
        assert magic < 2 ** 32, (n, magic)
    return {"tail_n": n, "tail_dp_end": dp_end, "tail_q": units // grid, "tail_rem": units % grid,
            "tail_magic": magic - 2 ** 32 if magic >= 2 ** 31 else magic, "tail_shift": shift}


def stream_tail_pieces(n_tiles: int, n: int, grid: int) -> list:
    """The host mirror of Sm90TailSchedule (kernels_cu/sm90_tail.cuh), for tests and tools: per CTA
    (blockIdx.x) the list of its pieces (tile, jb, je), in order."""
    tp = stream_tail_params(n_tiles, n, grid)
    dp_end, q, rem = tp["tail_dp_end"], tp["tail_q"], tp["tail_rem"]
    out = []
    for b in range(grid):
        pieces = [(t, 0, n) for t in range(b, dp_end, grid)]
        r = grid - 1 - b
        u = r * q + min(r, rem)
        u_end = u + q + (1 if r < rem else 0)
        while u < u_end:
            t, jb = dp_end + u // n, u % n
            je = min(n, jb + u_end - u)
            pieces.append((t, jb, je))
            u += je - jb
        out.append(pieces)
    return out


def sectioned_tile(tile: int, m_blocks: int, nheads: int, n_hb: int, section: int) -> tuple:
    """(m_block, head, batch) of tile number ``tile`` in the dynamic scheduler's order: the host
    mirror of sm90_sectioned_tile (kernels_cu/sm90_fwd.cu), for tests and tools."""
    per_section = section * m_blocks
    first_hb = tile // per_section * section
    in_section = tile % per_section
    width = min(section, n_hb - first_hb)
    hb = first_hb + in_section % width
    return m_blocks - 1 - in_section // width, hb % nheads, hb // nheads


class Sm90Forward(Family):
    name = "sm90_fwd"
    op = "fwd"
    version = 3
    config_cls = Sm90FwdConfig
    space = {"BM": (64, 128, 192), "BN": (64, 80, 96, 112, 128, 144, 160, 176, 192),
             "stages": (2, 3), "consumers": (1, 2, 3), "pingpong": (False, True),
             "persistent": (False, True), "emu_exp2": EMU_EXP2_SPACE, "dynamic": (False, True),
             "tma_store": (False, True), "p_smem": (False, True),
             **({"tile_overlap": (False, True)} if TILE_OVERLAP_IN_SPACE else {})}
    params_struct = "Sm90FwdParams"
    kernel_param_decl = "const __grid_constant__ cuflash::Sm90FwdParams"
    pointer_fields = ("q", "k", "v", "o", "lse")
    min_arch = (9, 0)
    arch_suffix = "a"
    priority = 1       # above fa2_fwd: on sm_90 every forward it supports runs here
    description = "Hopper forward: TMA ring, wgmma SS/RS, producer/consumer warpgroups, pingpong"
    features = ("alibi", "dropout", "softcap", "varlen", "window")

    def supports(self, arch, problem: Problem) -> str:
        # the problem's reasons first: they match fa2_fwd's, so the API's message stays one
        why = (f"{self.name} implements op {self.op!r}, not {problem.op!r}" if problem.op != self.op
               else check_head_dim(problem) or self.feature_problem(problem)
               or feature_mix(self, problem) or self.dropout_mix(problem) or self.varlen_mix(problem))
        if why:
            return why
        if tuple(arch)[0] != 9:
            return (f"{self.name} needs sm_90 exactly (sm_90a code: wgmma, TMA, setmaxnreg), "
                    f"got sm_{arch[0]}{arch[1]}")
        return ""

    def dropout_mix(self, problem: Problem) -> str:
        """Dropout with window / softcap / ALiBi where its instantiation compiles without spills
        (nvcc 13.0, sm_90a, at DROPOUT_BN): head dims 64 and 128, but not softcap at d128 (it
        spilled ~100 bytes when this was set; with drop_packed it builds without spills, session 25,
        but fixed lengths are not timed there) unless varlen (timed: tests/sm90_varlen_bwd_features_timing.py
        --fwd-features; tests/test_sm90_varlen_cpu.py holds its builds to zero spills); elsewhere '' is not returned, so selection falls back to
        fa2_fwd. tests/test_dropmix_cpu.py holds the allowed set to zero spills."""
        why = dropout_mix(self, problem)
        if not why:
            return ""
        d = self.head_dim_of(problem.head_dim)
        if d not in (64, 128) or (d == 128 and "softcap" in problem.features and not is_varlen(problem)):
            return why + f" at head dim {problem.head_dim} (its instantiation spills or is unchecked)"
        return ""

    def varlen_mix(self, problem: Problem) -> str:
        """'' unless ``problem`` is varlen with a feature whose varlen instantiation is not checked
        to compile without spills (VARLEN_FEATURES); selection then falls back to fa2_fwd."""
        if not is_varlen(problem):
            return ""
        others = tuple(f for f in problem.features if f != "varlen")
        if others and others not in VARLEN_FEATURES:
            return (f"{self.name} has no feature {others[0]!r} with varlen (features "
                    f"{', '.join(others)}: the varlen instantiation is unchecked)")
        return ""

    def for_problem(self, config, problem: Problem):
        # dropout and varlen are the call's, as in fa2_fwd (tuned tables and heuristics carry
        # none); so are the features
        dropout, varlen = "dropout" in problem.features, is_varlen(problem)
        if config.dropout != dropout or config.varlen != varlen:
            config = config.replace(dropout=dropout, varlen=varlen)
        if dropout and config.emu_exp2:   # not implemented with dropout: the plain exp2 (a speed knob)
            config = config.replace(emu_exp2=0)
        packed = dropout and not config.p_smem and (config.drop_packed or config.head_dim in DROPOUT_PACKED)
        if config.drop_packed != packed:
            # how dropout is applied (the same mask, the same bits): the module's switch for configs
            # without it (tuned tables carry no dropout), or the config's own; off without dropout
            config = config.replace(drop_packed=packed)
        # (DROPOUT_EARLY for dropout alone, fixed lengths: the kernels with window / softcap / ALiBi
        # / varlen next to it are unchecked for registers)
        early = config.drop_early
        if packed and not early and tuple(problem.features) == ("dropout",):
            early = DROPOUT_EARLY.get(config.head_dim, 0)
            if config.BN > {0: config.BN, 1: DROP_EARLY_SIGNS_BN, 2: DROP_EARLY_MASKS_BN, 4: DROP_EARLY_SIGNS_BN}[early]:
                early = 0   # a wider tile than the form is built for (a tuned or forced config's BN)
        early = early if packed else 0
        if config.drop_early != early:   # likewise (DROPOUT_EARLY), on drop_packed only
            config = config.replace(drop_early=early)
        # the softmax variants (speed knobs): fold_cap only with softcap, neither with dropout,
        # lazy_rescale with emu_exp2 only under fold_cap (kernels_cu/softmax_fold.cuh)
        if config.fold_cap and ("softcap" not in problem.features or dropout):
            config = config.replace(fold_cap=0)
        if config.masked_copy and (config.fold_cap < 3 or "alibi" in problem.features):
            config = config.replace(masked_copy=0)   # (a speed knob of the folded softcap step)
        if config.s_ahead and not (tuple(problem.features) == ("softcap",) and config.fold_cap >= 3 and not dropout):
            config = config.replace(s_ahead=False)   # likewise (a speed knob of the folded softcap step)
        if config.defer_max and (config.fold_cap < 3 or not config.lazy_rescale or "alibi" in problem.features
                                 or dropout):
            config = config.replace(defer_max=False)   # likewise (SOFTCAP_DEFER_MAX)
        if config.lazy_rescale and (dropout or (config.emu_exp2 and not config.fold_cap)):
            config = config.replace(lazy_rescale=False)
        if config.p_smem and problem.features:   # plain calls only (a speed knob): P in registers
            config = config.replace(p_smem=False)
        if config.rescale_first and problem.features:   # likewise: O rescaled after the P V wait
            config = config.replace(rescale_first=False)
        if config.tile_overlap and (problem.features not in ((), ("window",)) or is_varlen(problem)
                                    or problem.seqlen_k == 0 or problem.seqlen_q == 0):
            config = config.replace(tile_overlap=False)   # likewise; and without keys no S_0 to issue
        if config.stream_tail and (problem.features or problem.causal):
            config = config.replace(stream_tail=False)    # likewise (plain non-causal calls only)
        if config.pv_overlap and problem.features and not (
                tuple(problem.features) == ("softcap",) and config.fold_cap >= 3 and not dropout):
            config = config.replace(pv_overlap=False)     # likewise (plain calls, the folded softcap step)
        if config.cluster and (problem.features or problem.causal or is_varlen(problem)
                               or -(-problem.seqlen_q // config.BM) % 2):
            config = config.replace(cluster=False)        # likewise; and the pairs of Q blocks need an even count
        if config.rag_keys:   # the call's ragged block (a speed knob): plain non-causal fixed lengths only
            rag = problem.seqlen_k % config.BN
            plain = not (problem.features or problem.causal or is_varlen(problem) or config.tile_overlap
                         or config.stream_tail or config.cluster or config.pv_overlap or config.p_smem)
            rag = rag if plain and rag % 16 == 0 else 0
            if config.rag_keys != rag:
                config = config.replace(rag_keys=rag)
        if config.prefetch and is_varlen(problem):
            config = config.replace(prefetch=False)       # (a speed knob: fixed lengths only)
        if config.alibi_lin and (tuple(f for f in problem.features if f != "window") != ("alibi",)
                                 or config.emu_exp2 or config.tree_max):
            config = config.replace(alibi_lin=False)   # a speed knob: ALiBi alone (a window may join)
        config = self.with_features(config, problem)
        if config.tile_overlap and any("tile_overlap" in w for w in config.problems()):
            # a window's tile_overlap schedule (causal, dynamic, TMA store, two Q buffers) given to a call
            # without the window (e.g. one reaching past every key, which the API runs as the plain call)
            config = config.replace(tile_overlap=False)
        return config

    def for_bounds(self, config, problem: Problem):
        """tile_overlap off where a tile would have no K/V block (its S_0 is issued before the tile
        starts: cuflash.band every_q_block_has_keys, with the call's window bounds and lengths)."""
        if config.tile_overlap and not tile_overlap_fits(config, problem):
            config = config.replace(tile_overlap=False)
        return config

    def _fields(self, config):
        # dropout and varlen are not encoded either: the call sets them (for_problem), so the
        # encoded form of a config stays what it was before the flags existed
        # emu_exp2 only when on, so a plain config's encoded form is unchanged by the knob
        # dynamic likewise: only when on
        return ((k, v) for k, v in super()._fields(config)
                if k not in ("dropout", "varlen")
                and not (k in ("emu_exp2", "dynamic", "tma_store", "p_smem", "tree_max", "q_double",
                               "lazy_rescale", "fold_cap", "alibi_lin", "section", "rescale_first",
                               "tile_overlap", "drop_packed", "drop_early", "stream_tail", "pv_overlap", "cluster",
                               "masked_copy", "rag_keys", "prefetch", "s_ahead", "defer_max", "even_waves")
                               and not v))

    def make(self, point, problem: Problem):
        """As Family.make, with class_switches' speed switches; a point without emu_exp2 (tuned tables and
        recorded studies from before the knob) gets 0, the plain kernel."""
        if "emu_exp2" not in point:
            point = {**point, "emu_exp2": 0}
        if "dynamic" not in point:      # likewise from before the dynamic scheduler: off
            point = {**point, "dynamic": False}
        if "tma_store" not in point:    # and before the TMA-store epilogue
            point = {**point, "tma_store": False}
        if "p_smem" not in point:       # and before P through shared memory
            point = {**point, "p_smem": False}
        # the class's speed switches (HEURISTIC_LAZY): the points carry only the space's fields
        return self.class_switches(super().make(point, problem), problem)

    def head_dim_of(self, head_dim: int) -> int:
        """64, 96, 128, 192 or 256: the first compiled head dim >= the real one (65..96 -> 96)."""
        return next((d for d in HEAD_DIMS if d >= head_dim), HEAD_DIMS[-1])

    def heuristic(self, problem: Problem, arch=(9, 0), max_smem: Optional[int] = None) -> Sm90FwdConfig:
        """Two consumer warpgroups (BM = 128) with pingpong, two stages, and the BN that
        measured best at 16k on the H100 (results/NVIDIA_H100_80GB_HBM3/logs, sm90_check):
        d64 192, d128 176 (FA3's d128 tile too), d256 80; d192 112 (FA3's d192 tile, not yet
        measured here); d96 176, as d128 (not yet measured: FA3's d96 tile, 192 x 144 with three
        consumer warpgroups, exceeds the 3-consumer register budget here). A sliding window takes
        window_tiles' BN and the persistent schedule; dropout DROPOUT_BN (the Philox rounds
        need registers on top of O and S). Softcap (without dropout): SOFTCAP_EMU_EXP2 of every
        four 8-column tiles of S take the software exp2 (emu_exp2).

        Schedule of plain calls (HEURISTIC_DYNAMIC; calls with window / softcap / ALiBi take
        FEATURE_TILES' fields at the head dims it lists, SOFTCAP_FOLD's fold_cap and ALIBI_LINEAR's
        alibi_lin, each measured: see their note; elsewhere the static tiles): persistent CTAs with the dynamic scheduler, and at head dim
        128 below 16k keys BN 160 with the TMA-store epilogue (its staging tiles do not fit next
        to BN 176 / 192). Measured on the H100 against the shipped static tiles
        (results/NVIDIA_H100_80GB_HBM3/sched_timing.md, bf16, 2k-16k): d128 0.88-1.07x ->
        1.00-1.18x cuDNN, d256 causal 0.95-1.12x -> 1.04-1.18x, d64 causal 0.80-1.01x ->
        0.91-1.04x, the rest within 1-2%. Dropout alone (DROPOUT_DYNAMIC) takes the dynamic
        scheduler as well, without the TMA store (measured: DROPOUT_DYNAMIC's note). Varlen: the same tiles (a
        sequence's blocks are the fixed-length kernel's), scheduled by VARLEN_PERSISTENT (a CTA
        per tile: those past a sequence's end leave at once; with a window, window_tiles'
        persistent schedule), without the dynamic scheduler or the TMA-store epilogue (the
        kernel's kVarlen refuses both); tuned tables carry no varlen entries, so this is its
        config."""
        d = self.head_dim_of(problem.head_dim)
        max_smem = default_max_smem(arch) if max_smem is None else max_smem
        bn, persistent = {64: 192, 96: 176, 128: 176, 192: 112}.get(d, 80), False
        dynamic = tma_store = False
        if HEURISTIC_DYNAMIC and not problem.features:   # plain calls (measured so)
            persistent = dynamic = True
            if d == 128 and problem.seqlen_k < 16384:
                bn, tma_store = 160, True
        if "dropout" in problem.features:   # (with a window too: window_tiles' BN is no wider)
            bn = min(bn, DROPOUT_BN[d])
            if DROPOUT_EARLY.get(d) == 2 and tuple(problem.features) == ("dropout",):
                bn = min(bn, DROP_EARLY_MASKS_BN)   # the fragment masks' registers
            if HEURISTIC_DYNAMIC and DROPOUT_DYNAMIC and tuple(problem.features) == ("dropout",):
                persistent = dynamic = True   # (no TMA store: it spills with dropout at d128)
        feature_call = bool(problem.features) and "dropout" not in problem.features \
            and not is_varlen(problem)
        if "window" in problem.features:
            # (also under ALiBi: ptxas spilled with both at BN 192 (d64) / 176 (d128), not at 128)
            bn, persistent = window_tiles(d)
            dynamic = dynamic and persistent
        tiles = feature_tiles(problem, d) if feature_call else {}
        bn, persistent = tiles.get("BN", bn), tiles.get("persistent", persistent)
        dynamic = tiles.get("dynamic", dynamic) and persistent
        tma_store = tiles.get("tma_store", tma_store) and problem.seqlen_k < 16384
        if is_varlen(problem):
            dynamic = tma_store = False
            if "window" not in problem.features:
                persistent = VARLEN_PERSISTENT
        cfg = Sm90FwdConfig(128, bn, 2, 2, True, persistent, d, problem.dtype, bool(problem.causal),
                            dynamic=dynamic, tma_store=tma_store)
        if tuple(problem.features) == ("window",) and not is_varlen(problem):
            # FEATURE_TILES' q_double / tree_max for a window alone (with softcap / ALiBi their softmax
            # variants exclude them: Sm90FwdConfig's rules)
            cfg = cfg.replace(**{k: tiles[k] for k in ("q_double", "tree_max") if k in tiles})
        if (d == 64 and dynamic and not problem.features and problem.bucket >= HEURISTIC_D64_MIN_BUCKET
                and HEURISTIC_D64.get(bool(problem.causal))):
            cfg = cfg.replace(**HEURISTIC_D64[bool(problem.causal)])   # (first_fitting: the fallbacks)
            if (bool(problem.causal), problem.bucket) in HEURISTIC_D64_Q_DOUBLE:
                cfg = cfg.replace(q_double=True)
        if (d == 64 and dynamic and not problem.causal and not problem.features and not is_varlen(problem)
                and problem.seqlen_k <= SHORT_KEYS_MAX and cfg.BM == 128 and cfg.consumers == 2):
            # (short keys: the least padding; static persistent, the TMA-store epilogue)
            cfg = cfg.replace(BN=short_keys_bn(problem.seqlen_k), **SHORT_KEYS_FIELDS)
        if (d == 64 and dynamic and problem.causal and not problem.features and not is_varlen(problem)
                and problem.bucket < HEURISTIC_D64_MIN_BUCKET and cfg.BM == 128 and cfg.consumers == 2):
            cfg = cfg.replace(**SHORT_CAUSAL_FIELDS)   # (short causal calls: BN = BM, two Q buffers, TMA store)
        if (dynamic and not problem.causal and not problem.features and d in HEURISTIC_NC
                and problem.bucket >= HEURISTIC_NC_MIN_BUCKET):
            cfg = cfg.replace(**HEURISTIC_NC[d])   # static persistent (d256: without pingpong)
        if ((d, bool(problem.causal)) in HEURISTIC_TILE_OVERLAP and not problem.features
                and problem.bucket >= HEURISTIC_NC_MIN_BUCKET and cfg.persistent and not cfg.dynamic
                and not cfg.tma_store):
            cfg = cfg.replace(tile_overlap=True)   # the next tile's S_0 behind the last P V
        if ((d, problem.bucket) in HEURISTIC_STREAM_TAIL and not problem.features and not problem.causal
                and cfg.persistent and not cfg.dynamic and not cfg.tile_overlap):
            cfg = cfg.replace(stream_tail=True)    # the last stretch balanced by K/V blocks
        if ((d, problem.bucket) in HEURISTIC_CLUSTER and not problem.features and not problem.causal
                and cfg.persistent and not cfg.dynamic and not cfg.tile_overlap):
            cfg = cfg.replace(cluster=True, stream_tail=False)   # K/V loads shared by 2 CTAs
        if (d, bool(problem.causal)) in PV_OVERLAP and not problem.features:
            cfg = cfg.replace(pv_overlap=True)     # the softmax under the warpgroup's own P V
        if "softcap" in problem.features and "dropout" not in problem.features:
            cfg = cfg.replace(softcap=True, emu_exp2=SOFTCAP_EMU_EXP2)   # exp2s off the SFU
            fold = SOFTCAP_FOLD.get(d, 0)
            fold = 3 if fold == 4 and problem.dtype != "bf16" else fold   # (4 prescales Q in bf16 only)
            if fold and feature_call and not cfg.emu_exp2:   # (2 and 3 run with lazy_rescale)
                # the masked blocks' own copy of the step (where measured: softcap alone), and the
                # software exp2 where measured: bf16 softcap alone, not with the copy (MASKED_COPY's note)
                copy = MASKED_COPY.get((d, problem.dtype, bool(problem.causal)), 0) \
                    if fold >= 3 and tuple(problem.features) == ("softcap",) else 0
                if copy and softcap_fixed_m(problem) > 1:   # (the row-max step runs)
                    copy = MASKED_COPY_ROW_MAX.get((d, problem.dtype, bool(problem.causal)), copy)
                emu = SOFTCAP_FOLD_EMU_EXP2.get((d, bool(problem.causal)), 0) \
                    if problem.dtype == "bf16" and tuple(problem.features) == ("softcap",) and not copy else 0
                defer = (fold >= 3 and tuple(problem.features) == ("softcap",) and softcap_fixed_m(problem) > 1
                         and (d, problem.dtype, bool(problem.causal)) in SOFTCAP_DEFER_MAX)
                cfg = cfg.replace(fold_cap=fold, lazy_rescale=fold >= 2 or cfg.lazy_rescale, emu_exp2=emu,
                                  masked_copy=copy, defer_max=defer)
        if FEATURE_LAZY_RESCALE and feature_call and not cfg.emu_exp2:
            cfg = cfg.replace(lazy_rescale=True)
        if (feature_call and (d, bool(problem.causal)) in ALIBI_LINEAR
                and tuple(f for f in problem.features if f != "window") == ("alibi",)):
            cfg = cfg.replace(alibi=True, alibi_lin=True)   # (with_features sets the flag again)
        over = WINDOW_TILE_OVERLAP.get((d, bool(problem.causal), problem.dtype)) \
            if tuple(problem.features) == ("window",) and not is_varlen(problem) else None
        if over is not None:   # (the TMA store below 16k keys only, as the plain call's)
            over = dict(over, tma_store=over.get("tma_store", cfg.tma_store) and problem.seqlen_k < 16384)
            # (with_features sets the window flag again; where the config's other choices rule it out, as
            # lazy_rescale does, none; for_bounds: off per call where a tile has no keys)
            if cfg.persistent and not cfg.replace(window=True, tile_overlap=True, **over).problems():
                cfg = cfg.replace(window=True, tile_overlap=True, **over)
        return self.class_switches(first_fitting(cfg, ({"tma_store": False}, {"BN": 64, "tma_store": False},
                                                       {"BM": 64, "BN": 64, "consumers": 1, "pingpong": False,
                                                        "tma_store": False, "p_smem": False}),
                                                 max_smem), problem)

    def class_switches(self, config, problem: Problem):
        """``config`` with the speed switches measured for ``problem``'s class (HEURISTIC_LAZY: lazy_rescale,
        stream_tail off), for the heuristic's config and tuned entries' (make), where the config allows it;
        a config= given keeps its own fields."""
        if ((config.head_dim, bool(problem.causal), problem.bucket) in HEURISTIC_LAZY and not problem.features
                and not config.lazy_rescale):
            lazy = config.replace(lazy_rescale=True, stream_tail=False)
            config = config if lazy.problems() else lazy
        return config

    def kernel_names(self, config) -> dict:
        return {"main": config.kernel_name()}

    def launches(self, config, problem: Problem, sm_count: int) -> list:
        # one CTA per tile (Q block, head, batch), or per SM (persistent; one CTA fits an SM).
        # varlen: batch sequences, seqlen_q the longest (tiles past a sequence's end are empty)
        tiles = -(-problem.seqlen_q // config.BM) * problem.nheads * problem.batch
        if tiles >= 2 ** 31:
            raise ValueError(f"batch * nheads * seqlen_q: too many Q blocks for one launch ({tiles})")
        grid = (min(tiles, sm_count) if config.persistent else tiles, 1, 1)
        if getattr(config, "cluster", False):       # clusters of 2 CTAs (tiles is even: for_problem)
            grid = (max(2, grid[0] // 2 * 2), 1, 1)
        if getattr(config, "stream_tail", False):   # one partials slot per CTA (STREAM_TAIL_MAX_CTAS)
            grid = (stream_tail_grid(tiles, sm_count), 1, 1)
        if getattr(config, "even_waves", False):    # static persistent: the same tile count per CTA
            grid = (even_waves_grid(tiles, sm_count), 1, 1)
        return [LaunchSpec("main", grid, config.threads, config.smem_bytes)]

    def static_params(self, config, problem, strides, workspace, softmax_scale, sm_count) -> dict:
        # the tensor maps are written per call (call_writer); zeros until then
        # tile_counter: Plan writes the address of the zeroed counter it allocates (zeroed_counters)
        # varlen: o's batch stride is 0 (strides4), the cu_seqlens pointers are per call
        # (Plan.run_varlen / run_with), total_q the LSE's row length
        total_q = int(strides["totals"][0]) if is_varlen(problem) else 0
        return dict(tma_q=0, tma_k=0, tma_v=0, tma_o=0, **strides3("o", strides["o"]),
                    **forward_sizes(problem, softmax_scale), **feature_params(problem, softmax_scale),
                    **dropout_params(problem), tile_counter=0,
                    sched_section=sched_section(problem, config.section) if config.dynamic else 1,
                    cu_seqlens_q=0, cu_seqlens_k=0, total_q=total_q,
                    softcap_fixed_m=softcap_fixed_m(problem) if config.fold_cap >= 3 else 2.0,
                    tail_flags=0, tail_partial=0, **self._tail_params(config, problem, sm_count))

    def _tail_params(self, config, problem: Problem, sm_count: int) -> dict:
        """params.tail_* (stream_tail_params) for a stream_tail config, zeros otherwise."""
        if not getattr(config, "stream_tail", False):
            return dict.fromkeys(("tail_n", "tail_dp_end", "tail_q", "tail_rem", "tail_magic", "tail_shift"), 0)
        tiles = -(-problem.seqlen_q // config.BM) * problem.nheads * problem.batch
        return stream_tail_params(tiles, -(-problem.seqlen_k // config.BN), stream_tail_grid(tiles, sm_count))

    def zeroed_counters(self, config, problem: Problem) -> dict:
        """{params field: int32 count} of the counters a plan keeps between calls, zeroed once when
        the plan allocates them (cuflash.launch.Plan) and reset to 0 by the kernel itself: the
        dynamic scheduler's tile counter. One buffer per CUDA stream (cuflash.launch.StreamCounters),
        so calls of one plan on two streams may overlap without mixing their claims."""
        out = {"tile_counter": 1} if config.dynamic else {}
        if getattr(config, "stream_tail", False):
            out.update(stream_tail_buffers(config, -(-problem.seqlen_q // config.BM) * problem.nheads * problem.batch))
        return out

    def call_writer(self, config, problem: Problem, strides: dict, struct):
        """What cuflash.launch.Plan runs on every call after writing the pointers: the tensor
        maps of q, k, v (ptrs[0..2]) into the packed params ``buf`` (uint8), at their fields'
        offsets in ``struct`` (the params' NumPy dtype); with tma_store also o's (ptrs[3], box
        64 rows: one consumer warpgroup's store; never with varlen)."""
        shapes = map_shapes(problem, strides)
        rows = {"q": config.BM, "k": config.BN, "v": config.BN}
        jobs = tuple((i, struct.fields[f"tma_{t}"][1], shapes[t], tuple(strides[t]), rows[t])
                     for i, t in enumerate(("q", "k", "v")))
        offsets = [off for _, off, *_ in jobs]
        if offsets != list(range(offsets[0], offsets[0] + 3 * 128, 128)):
            raise RuntimeError(f"{self.params_struct}: tma_q, tma_k, tma_v must be adjacent")
        start, end = offsets[0], offsets[0] + 3 * 128
        dtype = problem.dtype
        # The three maps of one (q, k, v) address triple as one 384-byte array: a repeat call
        # (the common case: a training loop reuses its buffers) costs one dict lookup and one
        # copy. The plan fixes shapes, strides and boxes, so the addresses are the whole key.
        blobs: dict = {}

        def write(buf, ptrs):
            key = ptrs[:3]
            blob = blobs.get(key)
            if blob is None:
                if len(blobs) >= 64:
                    blobs.clear()
                blob = blobs[key] = np.frombuffer(b"".join(
                    tensor_map(dtype, ptrs[i], shape, st, r) for i, _, shape, st, r in jobs), np.uint8)
            buf[start:end] = blob

        if not getattr(config, "tma_store", False):
            return write
        o_job = (shapes["q"], tuple(strides["o"]), 64)
        o_start = struct.fields["tma_o"][1]
        o_blobs: dict = {}

        def write_with_o(buf, ptrs):
            write(buf, ptrs)
            blob = o_blobs.get(ptrs[3])
            if blob is None:
                if len(o_blobs) >= 64:
                    o_blobs.clear()
                shape, st, r = o_job
                blob = o_blobs[ptrs[3]] = np.frombuffer(tensor_map(dtype, ptrs[3], shape, st, r), np.uint8)
            buf[o_start:o_start + 128] = blob

        return write_with_o


FAMILY = register(Sm90Forward())
