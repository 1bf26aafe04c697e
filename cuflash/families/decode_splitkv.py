"""decode_splitkv: flash-decoding for flash_attn_with_kvcache (kernels_cu/decode_splitkv.cu), sm_80+.

Op ``decode``: a few query rows per sequence over a long KV cache, bound by memory bandwidth.
Three kernels by role: ``append`` (new k, v into the cache, rotary on q and k), ``main`` (one
CTA per (split, KV head · row block, batch): the query heads of a KV head packed as rows of one
Q tile, the split's K/V blocks through a cp.async ring, mma.sync, fp32 partials) and
``combine`` (the LSE merge of the splits). One split writes the output directly and skips the
combine.

The Hopper loop (config field ``tma``, sm_90 only; kernel ``decode_splitkv_tma``): the same
consumer warps plus a producer warp that streams the split's K/V blocks by TMA into a ring of
``stages`` slots with full / empty mbarriers, so every slot can be in flight and no consumer
issues loads. The K and V tensor maps (box: head_dim + 8 columns, whose 8 out-of-bounds columns
arrive as zeros and pad the shared-memory rows as the consumers' ldmatrix expects, by the block's
keys or, paged, by ``tma_box_rows`` keys per page segment) are encoded on the host by
``cuTensorMapEncodeTiled`` and written into the packed params per call by ``call_writer``, cached
per (k_cache, v_cache) address pair: a CUDA graph captures them by value, like every pointer
argument (reuse the captured cache tensors across replays; contents and cache_seqlens may change).
The plain kernels are compiled exactly as before (their SASS is unchanged): they take
``DecodeParams``, a prefix of the packed ``DecodeTmaParams``.

Which loop runs (H100 timing in the TMA_DEFAULT / TMA_PAGED_DEFAULT notes below): the cp.async
loop, which streams contiguous caches and large pages as fast or faster. With TMA_PAGED_DEFAULT
(off: faster at small batch, slower at large; see its note), paged caches with pages under
TMA_PAGED_MAX_PAGE keys take the Hopper loop (4 warps, 3 stages), else with SMALL_PAGE_WARPS = 4
the cp.async loop with 4 warps, chosen per call by ``call_config`` (the page size is the call's,
not the problem class's). Options of the cp.async loop (module switches below): ``l2_prefetch``
(an L2 prefetch-size hint on the K/V copies, on for contiguous caches), ``warp_loads`` (each warp
loads the rows it reads: no CTA barrier per block) and ``page_gather`` (paged: a block's page ids
read before its copies).

The number of splits is the config's ``splits`` (1..128), fixed before a plan is made:
``cuflash.decode`` puts the call's ``num_splits`` there, or the heuristic's choice
(``num_splits_for``) for ``num_splits=0``. It depends on shapes only (batch, heads, the
cache capacity, the SM count), never on tensor values: the per-row split boundaries are
computed on the device from ``cache_seqlens``, so a captured CUDA graph stays valid when the
lengths change. With ``dynamic`` 1 (the heuristic's for batch 1 x 8 KV heads from 64k cached keys,
DYNAMIC_DEFAULT) a group's splits share its blocks by claims from a counter instead (the fused
combine's last CTA resets it, so replays find it at 0 too).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from ..problem import Problem
from ..registry import register
from .base import Family, KernelConfig, LaunchSpec, default_max_smem

MAX_HEAD_DIM = 256
MAX_SPLITS = 128          # flash-attn's limit on num_splits
MAX_ACCUM_REGS = 192      # fp32 accumulators per thread (O and S) before ptxas spills
MIN_SPLIT_BLOCKS = 2      # the heuristic gives each split at least this many K/V blocks
LOG2E = 1.4426950408889634
SMEM_RESERVED = 1024      # shared memory the system reserves per CTA
MAX_THREADS_PER_SM = 2048
ALIGN = 256               # workspace pieces start on 256-byte boundaries
TMA_MAX_HEAD_DIM = 240    # tma: a box row is head_dim + 8 elements, at most 256
TMA_PAGE_MULTIPLE = 16    # tma: paged caches need page sizes that are multiples of this
# tma with 8 or more warps (9+ with the producer): ptxas caps a thread at 168 registers (a
# sub-partition's 16K registers over its 3 warps), and d128 with two row tiles (144 accumulator
# registers) spills 216 bytes (nvcc 13.0, sm_90a); 80 (d64 with two tiles, d128 with 32-key
# warps) compile clean. tests/test_decode_tma_cpu.py holds the allowed set to zero spills.
TMA_MAX_ACCUM_REGS_WIDE = 96
COMBINE_ROWS = 4          # decode_combine: one warp per row, 4 warps per CTA
APPEND_THREADS = 128
APPEND_CTAS = 32         # decode_append: CTAs per batch row, striding over the new tokens
# num_splits_for: what the separate decode_combine launch costs (in K/V blocks of one CTA) when
# there is more than one split and the config has no fused combine (a second kernel's launch
# gap and its pass over the partials); not yet fitted to a measurement
COMBINE_LAUNCH_COST = 1
# The heuristic's choice of the two compile-time options. fused_combine: on. H100, session 15
# round A (tests/decode_tma_timing.py, bf16 d128 32:8 heads, CUDA graphs, with the split merge's
# batched loads in both paths): the heuristic's time over the fused one's, geomean 1.015 over the 9
# contiguous cells (worst 0.999), 1.016 over the 18 paged ones (worst 0.997), 1.077 in the cold-L2
# 1 x 8k cell; 1 x 8k 16.6 -> 15.3 us (one launch: the separate combine took 2.7 us plus a 1.0 us
# gap), 1 x 32k 54.5 -> 53.0, 1 x 128k 188.0 -> 186.6. A call shape's first call made inside a
# CUDA-graph capture cannot allocate the zeroed split counters: cuflash.decode then plans it with
# the separate combine (a given config with fused_combine raises there). page_prefetch: off
# (session 12: 10-20% slower).
FUSED_COMBINE_DEFAULT = True
PAGE_PREFETCH_DEFAULT = False
# The heuristic's choice of the Hopper loop (tma) on sm_90 for every call it can run (head dims
# that are multiples of 16 up to TMA_MAX_HEAD_DIM; cuflash.decode falls back to the cp.async loop
# for page sizes that are not multiples of 16): off. Measured on the H100 (tests/decode_timing.py,
# bf16 d128 32:8 heads, CUDA graphs; logs/session13_dec4 in the lead's results), contiguous caches
# stream as fast or faster through the cp.async loop: 1x8k 18.0 vs 17.9-18.4 us, 1x32k 56.4 vs
# 56.0-57.6, 1x64k 102.4 vs 103.4-105.0, 1x128k 195.0 vs 203.1-206.5, 8x32k 375.2 vs 392.4 (the
# loop's best split count, 4), 32x8k 372.7 vs 381.1, 64x32k 2956 vs 3056.
TMA_DEFAULT = False
# Paged caches with pages of fewer than TMA_PAGED_MAX_PAGE keys take the Hopper loop on sm_90
# (DecodeSplitKV.call_config, for configs the heuristic chose): its producer reads one page id
# per box instead of one per key row. Measured there, page 16: 32x8k 402.3 us (4 warps, 3 stages)
# / 395.1 (8 warps) against 419.8 for the cp.async loop (contiguous 372.7), 1x32k 60.0 / 62.3
# against 63.1 (contiguous 56.4): within 7% of contiguous where the cp.async loop was 12% off.
# Page 256: a tie or up to 2% slower (32x8k 383.5-394.3 against 376.0; 1x32k 57.1 against 57.8),
# so those stay on the cp.async loop. 4 warps (64-key blocks, 3 stages, two CTAs per SM) gained
# in both page-16 cells.
# Session 13's racecheck hazards in decode_splitkv_tma are fixed (racecheck clean on the H100,
# session 14 round A, with the Hopper loop forced both ways). Off on timing: session 14 round A,
# page 16, 4 warps x 3 stages against the cp.async loop's 8 warps: faster at batch 1 and 8 up to
# 32k keys (19.8 / 58.7 / 102.3 / 386.6 us against 22.1 / 64.1 / 111.3 / 422.7 at 1x8k, 1x32k,
# 8x8k, 8x32k), slower at 8 x 128k, 32 x 32k and 32 x 128k (1751 / 1739 / 7401 against 1654 /
# 1663 / 6558); contiguous caches are 2-15% slower on the Hopper loop (TMA_DEFAULT).
TMA_PAGED_DEFAULT = False
# The tuning space's values of ``tma`` ((False,): the tuner never tries the Hopper loop)
TMA_SPACE = (False, True)
TMA_PAGED_MAX_PAGE = 128
# The heuristic's split rule for the Hopper loop (its split_cost, in K/V blocks; see
# num_splits_for): the cp.async loop's until the H100 timing refits it
TMA_SPLIT_COST = 4
# l2_prefetch: the L2 prefetch sizes the cp.async loop's K/V copies may carry (0: none), those in
# the tuning space (run on the H100: 128 and 256), and the heuristic's choice for contiguous
# caches (paged ones take none). H100, session 14 round A (tests/decode_tma_timing.py, one
# timing per record): 256 bytes was 1-2.6% faster in 8 of the 9 contiguous cells from 1 x 32k to
# 32 x 128k (e.g. 5737 against 5844 us at 32 x 128k, 365.7 against 372.4 at 8 x 32k), equal at
# 1 x 8k, 0-2% slower on paged caches, and 29.8 against 22.5 us in the cold-L2 1 x 8k cell (one
# reading; identical configs differed by up to 8% in that run). The repeated run (session 14
# round F2a, tests/decode_tma_timing.py --repeat 3 --propose "L2_PREFETCH_DEFAULT=256",
# logs/session14_rounds/f2a/dec_prop.log): contiguous caches 1.7% faster over the 9 cells (worst
# cell 0.996, at 1 x 8k), the cold-L2 cell 1.007: on at 256.
L2_PREFETCH_SIZES = (0, 64, 128, 256)
L2_PREFETCH_SPACE = (0, 128, 256)
L2_PREFETCH_DEFAULT = 256
# warp_loads: the heuristic's choice, and the tuning space's values. Its GPU tests
# (tests/test_decode_bandwidth_gpu.py) pass on the H100 (session 16 rounds C, D); racecheck not run.
# Timed there (round C, logs/session16_rounds/c2/json_dec7, with the fused combine and the L2
# hint): 1 x 8k 14.8 against 15.0 us, 1 x 32k 53.0 / 53.2, but 1 x 128k 190.6 / 187.4 and 32 x 8k
# 374.2 / 363.6: off and out of the space.
WARP_LOADS_DEFAULT = False
WARP_LOADS_SPACE = (False,)
# page_gather (paged caches: a K/V block's page ids read before its cp.asyncs, not one dependent
# table read per row pass): the heuristic's choice and the tuning space's values. Measured slower
# on the H100 (session 15 round A, tests/decode_tma_timing.py ``base_pg`` against ``base``, 8 warps):
# 0.83-0.94 in all 18 paged cells, page 256 as much as page 16 (1 x 32k page 16 71.4 against 64.3
# us, page 256 70.3 against 58.4; 32 x 32k page 16 1818 against 1688), and with 4 warps worse still
# (as session 12's page_prefetch, which shares its address path): off and out of the space.
PAGE_GATHER_DEFAULT = False
PAGE_GATHER_SPACE = (False,)
# Paged caches with pages under TMA_PAGED_MAX_PAGE keys, when the heuristic chose and the Hopper
# loop does not take them (TMA_PAGED_DEFAULT off, or not sm_90): the cp.async loop with this many
# warps (4: 64-key blocks, 3 stages, two CTAs per SM, the split rule filling both; 8: the
# contiguous tiles). H100, page 16 (tests/decode_tma_timing.py, session 14 round A): 4 warps at
# two CTAs per SM 1504 us at 32 x 32k, 384 at 32 x 8k, 6042 at 32 x 128k against 1663 / 424 /
# 6558 for 8 warps; at one CTA per SM (batch 1 and 8, before the split rule filled both slots)
# 4 warps lost (85 against 64 us at 1 x 32k). On (4) with PAGED_SPLIT_RULE_RESIDENT and
# SMALL_PAGE_TMA_MAX_KEYS (small calls take the Hopper loop): see there.
SMALL_PAGE_WARPS = 4
# Small pages, by call size (DecodeSplitKV.call_config, heuristic's configs): calls of at most this
# many cached keys in all (batch x capacity) take the Hopper loop like TMA_PAGED_DEFAULT (4 warps,
# 3 stages), larger ones the SMALL_PAGE_WARPS rule; 0: off. Session 14's H100 timing, page 16:
# the Hopper loop was the fastest at batch 1 and 8 up to 32k keys (1x8k 19.8 us against 22.1 on the
# cp.async loop's 8 warps, 1x32k 58.7 against 64.1, 8x8k 102.3 against 111.3, 8x32k 386.6 against
# 422.7) and 4 warps with the resident split rule from there on (1x128k 205.5 against 222.4, 8x128k
# 1513 against 1672, 32x8k 386 against 430, 32x32k 1517 against 1679, 32x128k 5940 against 6560),
# each then within 10% of the contiguous cache but 1x8k / 1x32k on the 4-warp rule (1.43 / 1.13):
# 65536 (1 x 32k, 8 x 8k; at 8 x 32k the two were within 1%) with SMALL_PAGE_WARPS = 4 and
# PAGED_SPLIT_RULE_RESIDENT, timed together on the H100 (session 15 round B, tests/
# decode_tma_timing.py --propose, page 16 against the 8-warp cp.async loop): 1.103 geomean over the
# 9 page-16 cells, worst 1.047 (32 x 128k), none slower; page 16 over contiguous now 1.03-1.12
# (1x8k 16.3 against 15.3 us, 1x32k 58.5 / 53.1, 8x8k 109.1 / 97.8, 8x32k 388.9 / 368.7, 32x32k
# 1520 / 1462, 32x128k 5935 / 5776), where the 8-warp loop was 1.14-1.28. Page 256 and contiguous
# caches keep their configs. On. Session 18 round 1 (tests/decode_tma_timing.py --no-candidates
# --propose, page 16, CUDA graphs; logs/session18_dec9/r1/dec9_page16.json): the
# calls of 65536 keys run faster on the 4-warp rule than on the Hopper loop, 8 x 8k 103.5 against
# 107.1 us (contiguous 97.6: 1.060 against 1.098), 1 x 64k 105.9 against 109.0 (contiguous 96.6:
# 1.095 against 1.128); 1 x 128k on the Hopper loop lost (208.2 against 199.7): 32768.
SMALL_PAGE_TMA_MAX_KEYS = 32768
# num_splits_for's model for paged caches with two or more resident CTAs per SM (see there): on,
# with SMALL_PAGE_WARPS = 4 (4 warps at one CTA per SM is what lost above) and the Hopper loop for
# the small calls where 4 warps still lost (SMALL_PAGE_TMA_MAX_KEYS; measured together there).
PAGED_SPLIT_RULE_RESIDENT = True
# Contiguous caches (issue 13, session 16): the heuristic's tiles at head dims up to 128
# (CONTIGUOUS_WARPS warps of 16 keys, CONTIGUOUS_STAGES K/V blocks in the ring; 8 x 3: one CTA of
# 213 KB per SM) and the split rule's model of co-resident CTAs (SPLIT_RULE_RESIDENT_CONTIGUOUS:
# on, CTAs resident together stream side by side, as PAGED_SPLIT_RULE_RESIDENT for paged caches,
# so the rule fills every resident slot; off: they share the SM's bandwidth). ncu on the H100
# (session 16) showed 32 x 8k at one CTA per SM (1.94 waves), no CTA's prologue or epilogue
# overlapping another's streaming. Timed in session 16 round A (tests/decode_tma_timing.py, each
# with the fused combine and the L2 hint; logs/session16_rounds/a1/json_dec7): 4 x 3 (64-key
# blocks, two CTAs per SM) ties 8 x 3 from batch 8 (8 x 32k 370.6 against 367.4 us, 32 x 32k
# 1454 / 1449) and gains 1-2% only at batch 64 (64 x 8k 725 / 735, 64 x 32k 2886 / 2914), loses at
# batch 1 (1 x 8k 18.1, or 16.7 with the co-resident rule's 32 splits, against 15.2; 1 x 128k
# 192.1 / 187.0); 4 x 2 (three CTAs per SM) and 4 x 6 (one CTA, 5 blocks in flight: 1 x 8k 22.7)
# lose. The proposal (4 warps + the co-resident rule) kept 8 x 3: 0.92 in the cold 1 x 8k cell.
# So per-SM streaming is not bound by the ring's depth or by CTA turnover but by the warps' own
# instruction latency (ncu: 0.34 issued per scheduler per cycle): 8, 3, off.
CONTIGUOUS_WARPS = 8
CONTIGUOUS_STAGES = 3
SPLIT_RULE_RESIDENT_CONTIGUOUS = False
# ... except for calls with at least this many (batch, KV head, row block) groups (0: never),
# which take 4 warps x 3 stages (two CTAs per SM) at their split rule's count. H100, session 16
# rounds A and C (logs/session16_rounds/a1, c2: json_dec7), 32:8 heads: at batch 64 (512 groups)
# 64 x 8k 725 / 724 us against 735 / 735 for 8 x 3, 64 x 32k 2886 / 2891 against 2914 / 2927,
# 64 x 128k 11596 / 11601 (9 splits) against 11822 / 11814 (1.0-1.9% faster); at batch 32 (256
# groups) 0.4-1.7% slower (32 x 128k 5842 / 5835 against 5729 / 5736): on from 512.
CONTIGUOUS_SMALL_TILE_MIN_GROUPS = 512
# Pages of TMA_PAGED_MAX_PAGE keys or more (page 256): calls of at most this many cached keys in
# all (batch x capacity) take the Hopper loop (4 warps, 3 stages) when the heuristic chose, as
# small pages do under SMALL_PAGE_TMA_MAX_KEYS; 0: off (the cp.async loop's 8 warps, as
# contiguous caches). H100, session 16 round A (tests/decode_tma_timing.py, bf16 d128 32:8 heads,
# page 256, CUDA graphs; logs/session16_rounds/a1/json_dec7): 1 x 8k 15.4 us on the Hopper loop
# (4 warps, 32 splits) against 18.7 for the cp.async loop (contiguous 15.2: 1.01x where it was
# 1.23x), but 1 x 32k 56.0 against 54.5 and 8 x 32k 406.0 against 379.6: on up to 8192 keys.
LARGE_PAGE_TMA_MAX_KEYS = 8192
# lean (the cp.async loop): Q's mma fragments kept in registers (one ldmatrix pass per CTA, not
# per block) and O rescaled only when a row's running max grew (a warp vote). ncu (session 16,
# 32 x 8k) found the SMs issuing 0.34 instructions per cycle per scheduler at 2 warps each, which
# this lowers; but cuDNN's kernel issues 0.15 and streams faster (session 16 round C ncu, see
# tests/decode_ncu_probe.py): the issue rate is not what bounds it. Its GPU tests pass on the H100
# (session 16 round D, tests/test_decode_resident_gpu.py); not timed: off and out of the tuning
# space (the heuristic's choice and the space's values).
LEAN_DEFAULT = False
LEAN_SPACE = (False,)
# bulk (the cp.async loop, sm_90): 0: 16-byte cp.asyncs; 1: one cp.async.bulk per whole key row
# (256 bytes at d 128) on a per-slot mbarrier; 2: as 1 with an L2 evict-first policy. Session 16's
# ncu (32 x 8k) saw cuflash's 16-byte copies look each 32-byte L2 sector up twice where cuDNN's
# kernel looks it up once. Timed on the H100 (session 17 round A, tests/decode_tma_timing.py, bf16
# d 128 32:8 heads, CUDA graphs, fused combine; logs in notes/gpu_result_dec8.md): slower in every
# cell. The heuristic's 8 x 3 tiles: 1 x 8k 18.6 / 18.8 us (bulk 1 / 2) against 15.0, 1 x 32k
# 56.6 / 56.2 against 53.2, 1 x 128k 197.2 / 201.0 against 187.4, 8 x 32k 385.6 / 388.5 against
# 369.2, 32 x 8k 386.7 / 394.2 against 367.5, 32 x 32k 1538 / 1566 against 1467; 4 x 3 (two CTAs
# per SM) 381.5 at 32 x 8k, 4 x 6 27.8 at 1 x 8k; paged (a table read per row) 0.94-1.00 of the
# cp.async loop's 8 warps, page 16 on 4 warps 1.01-1.06 of it but behind the heuristic's choice
# (1 x 32k 60.8 against 57.5 us, 32 x 32k 1589 against 1510). ncu (1 x 32k): the bulk rows halve
# the L2 lookups (1.27 M hits against 4.14 M) yet DRAM throughput falls from 66% to 56% of peak:
# the copy engine's per-row requests stream slower than the SMs' own 16-byte copies here. Its GPU
# tests pass (tests/test_decode_bulk_gpu.py). Off and out of the tuning space.
BULK_DEFAULT = 0
BULK_PAGED_DEFAULT = 0    # the same for paged caches (a table read per row, then its bulk copy)
BULK_SPACE = (0,)
BULK_VALUES = (0, 1, 2)
# early_merge (fused combine): the merging CTA issues its first batch of partial-O loads before the
# LSE loads (one L2 round trip fewer on the critical path of calls with more than one split).
# H100 (tests/decode_tma_timing.py, bf16 d 128 32:8 heads, CUDA graphs, shuffled rounds): session
# 17 round 3 (notes/gpu_result_dec8_c.md), the heuristic with it (prop) against without: 1 x 8k
# 15.0 against 15.2 us, 1 x 32k 53.7 / 53.8, 8 x 8k 97.9 / 97.9, 1 x 128k 187.5 / 188.1, 8 x 32k
# 369.8 / 370.4, cold-L2 1 x 8k 20.7 / 21.1 (geomean 1.005, no cell slower); round 2 on the bulk
# rows: 1 x 8k 18.2 / 18.4, 1 x 32k 54.7 / 55.6, 8 x 8k 99.2 / 102.5. At one split (batch >= 32)
# the merge does not run. GPU tests pass on both loops (tests/test_decode_bulk_gpu.py::
# test_early_merge); racecheck clean (round 3, gpu_sanitize.py --quick, SANITIZE_DECODE_SWITCH=
# BULK_DEFAULT: the bulk + early-merge pass). On, and in the tuning space.
EARLY_MERGE_DEFAULT = True
EARLY_MERGE_SPACE = (False, True)
# ring_fill (the cp.async loop): 0: the prologue loads stages - 1 K/V blocks and each iteration
# the next, before O += P V; 1: the prologue fills every ring slot (one block more requested at
# the start: a third more at 3 stages, where a batch-1 CTA streams only 4 blocks at 8k keys);
# 2: as 1, each iteration's load issued before S. The heuristic's choice and the tuning space's
# values: 0 until timed (session 20).
RING_FILL_DEFAULT = 0
RING_FILL_SPACE = (0,)
RING_FILL_VALUES = (0, 1, 2)
# dynamic (the cp.async loop with ring_fill; no bulk, page_prefetch, warp_loads): 1 (with the
# fused combine): the splits of a (batch, KV head, row block) group claim its K/V blocks one at a
# time from a counter instead of taking equal runs, so the CTAs that stream faster take more and
# the group's CTAs end together; 2: the claims' interleaved order (split s takes the group's
# blocks s, s + splits, ...) without claims. ncu (H100, session 16, 1 x 8k, 16 splits, one CTA per
# SM, cold L2): the SMs were active 28.8k cycles on average against 39.4k for the busiest.
# The heuristic's choice: DYNAMIC_DEFAULT on contiguous caches for calls of at most
# DYNAMIC_MAX_GROUPS groups and at least DYNAMIC_MIN_KEYS cached keys (ring_fill at least 1 there).
# H100, session 20 round 1 (tests/decode_tma_timing.py --no-candidates, bf16 d 128 32:8 heads,
# CUDA graphs, 3 shuffled repeats; logs/session20_dec10/r1): with ring_fill 1, 1 x 128k 181.8 us
# against 187.8 for the heuristic (cuDNN 180.9), 1 x 64k 96.7 against 97.5 (cuDNN 95.7), but
# 1 x 32k 53.6 / 53.0, 1 x 8k 17.0 / 15.1, 8 x 8k 98.5 / 97.3, 8 x 32k 365.9 / 366.3 (2 splits),
# and paged (page 16, the 4-warp rule's two CTAs per SM) 12-29% slower (1 x 128k 234 / 200): on
# for batch 1 x 8 KV heads from 64k keys. Round 2 (logs/session20_dec10/r2, same script, with this
# rule; against DYNAMIC_DEFAULT=0 in the same process): 1 x 128k 184.0 against 191.0 us (cuDNN
# 182.6), 1 x 64k 97.2 / 98.2 (cuDNN 95.1); the interleaved order alone (2) 190.3 / 98.5 there and
# 0.96-1.03 elsewhere: the gain is the claims'. The capacity decides here; the kernel then takes
# the claims only for groups of at least 32 K/V blocks per split (kClaimMinBlocks: the row's
# keys, known on the device), else equal runs, so a large cache holding few keys keeps the
# static split's cost.
DYNAMIC_DEFAULT = 1
DYNAMIC_MAX_GROUPS = 8
DYNAMIC_MIN_KEYS = 65536
DYNAMIC_SPACE = (0,)
DYNAMIC_VALUES = (0, 1, 2)

# stream (decode_splitkv_stream, stream-K): every group's K/V blocks as one list, cut into equal
# ranges over C = SMs x resident CTAs (at most STREAM_MAX_CTAS); a range crosses group boundaries,
# and a group's pieces are merged by the last of its CTAs (the fused combine's counters). The
# split kernel gives every group the same number of CTAs, which leaves SMs idle (8 groups x 16
# splits = 128 CTAs on 132 SMs; 32 x 8 groups on 132 SMs take 1.94 waves). Runs calls without a
# window (causal only at seqlen_q 1) of at most STREAM_MAX_BATCH batch rows. The heuristic's
# choice (contiguous caches, the contiguous tiles): off. H200 (session 21 round 4,
# tests/decode_tma_timing.py --no-candidates --propose "STREAM_DEFAULT=1", CUDA graphs, against the
# heuristic in the same process; results/NVIDIA_H200/logs/session21_dec11/r4): 1 x 8k 16.9 against 14.7 us, 1 x 32k 43.2 /
# 40.2, 8 x 32k 271.9 / 268.6, 32 x 8k 272.1 / 264.8; faster than the claims at 1 x 64k (76.0 / 82.8)
# and 1 x 128k (139.8 / 158.9) but slower than equal runs there (72.6 / 136.9). Idle SMs and partial
# waves are not what keeps decode_splitkv under cuDNN.
STREAM_DEFAULT = False
STREAM_PAGED = False      # the heuristic's stream on paged caches too
STREAM_FORCE_CTAS = 0     # tests: this many CTAs instead of the resident slots (0: the slots)
# the CTA count: with at most as many groups as resident slots, the largest multiple of the groups
# (8 groups on 132 SMs: 128 CTAs, 16 per group). H200 (session 21 round 3, CUDA graphs, 32:8 heads):
# 128 CTAs against 132 at 1 x 32k 44.3 / 52.8 us, 1 x 128k 141.5 / 149.9, 8 x 32k 269.5 / 273.5
STREAM_WHOLE_GROUPS = True
STREAM_SPACE = (False,)
STREAM_MAX_BATCH = 128    # kStreamMaxBatch: the per-row prefix the kernel keeps in shared memory
STREAM_MAX_CTAS = 160     # kStreamPerLane: the merge of a group's pieces, 5 per lane of one warp
STREAM_SMEM_INTS = 4 * STREAM_MAX_BATCH + 2
# light_fence (the split kernel's fused combine): the count of finished splits without a
# __threadfence per thread on either side (the CTA barrier and thread 0's acq_rel atomic; the
# stream kernel always counts so). The heuristic's choice, for contiguous caches (paged ones not
# timed): on. H200 (session 21 round 4, tests/decode_tma_timing.py --no-candidates --propose
# "LIGHT_FENCE_DEFAULT=1", bf16 d 128 32:8 heads, CUDA graphs, 3 shuffled repeats, against the
# heuristic in the same process; results/NVIDIA_H200/logs/session21_dec11/r4): 1 x 8k 14.4 against 14.7 us, 1 x 32k
# 40.0 / 40.2, 1 x 64k 82.5 / 82.8, 1 x 128k 157.0 / 158.9, 8 x 32k (2 splits) 268.8 / 268.6; at 32 x
# 8k (one split: no count) 266.5 / 264.8, the same code run (geomean 1.007); racecheck clean.
LIGHT_FENCE_DEFAULT = True
LIGHT_FENCE_SPACE = (False,)
# regs (decode_splitkv_regs): each warp loads its keys' K and V rows by 16-byte loads straight
# into registers (no cp.async, no shared-memory ring, no barrier per block) and runs the mma
# transposed (Sᵀ = K Qᵀ, Oᵀ += Vᵀ Pᵀ: 8 packed query rows per row tile); the loads' cache hints
# (kLoadHint = regs - 1, ptx_decode.cuh ld_kv_16): 1 none, 2 L1::no_allocate + L2::256B, 3 as 2 with
# an L2 evict-first policy, 4 L1::no_allocate, 5 L2::256B, 6 the evict-first policy. Head dims 64
# and 128 equal to the config's. The heuristic's choice (REGS_DEFAULT) with REGS_WARPS warps of 16
# keys, on sm_90 at head dim 128 (REGS_HEAD_DIM_DEFAULT; d 64 is not timed), contiguous and paged:
# 6. Measured on one H200 (no H100 came; tests/decode_tma_timing.py --no-candidates, bf16 d 128
# 32:8 heads, CUDA graphs, 3 shuffled repeats, cuDNN and the old heuristic in the same process;
# results/NVIDIA_H200/logs/session22_dec12/r2), us, regs 6 / regs 1 / old heuristic / cuDNN:
# 1 x 8k 12.7 / 12.6 / 14.0 / 11.0, 1 x 32k 39.4 / 40.1 / 39.9 / 37.8, 1 x 64k 69.0 / 69.7 / 84.1 /
# 68.1, 1 x 128k 128.0 / 128.4 / 160.9 / 127.8, 8 x 32k 247.9 / 248.0 / 267.2 / 246.2, 32 x 8k
# 245.7 / 246.8 / 264.3 / 245.0 (geomean 1.122 over the old heuristic). The L2::256B prefetch
# hint (5) is slower (1 x 128k 133.0, 1 x 32k 43.3), and so are 4 warps with two CTAs per SM at
# the co-resident split rule (1 x 32k 43.3 at 32 splits). Paged (regs 1): page 16 1 x 64k 72.5
# against the old 99.9 (1.04x regs' contiguous), 32 x 8k 255.1 / 364.4; page 256 1 x 64k 69.9
# against 99.5, 8 x 32k 247.8 / 381.5. ncu (1 x 32k, warm L2): 4.50 M instructions against the
# cp.async loop's 11.29 M and cuDNN's 5.45 M; 8 x 32k 89.7% of DRAM peak against 83.8% (cuDNN 91.8%).
REGS_DEFAULT = 6
REGS_HEAD_DIM_DEFAULT = (128,)
# Paged calls of pages under TMA_PAGED_MAX_PAGE keys with at most this many keys in all keep the
# Hopper loop (as before the regs kernel): H200, session 22 round 3 (results/NVIDIA_H200/logs/
# session22_dec12/r3), 1 x 8k page 16: the Hopper loop 14.1 us against regs' 14.5; 1 x 64k page 16:
# the old choice 100.9 against regs' 70.6.
REGS_PAGED_TMA_MAX_KEYS = 8192
# REGS_WARPS: H100, session 23 (dec14, logs/session23_dec14/r1, tests/decode_tma_timing.py --no-candidates,
# bf16 d 128 32:8 heads, CUDA graphs, against the heuristic and cuDNN in one process), 4 warps at the
# co-resident split rule (two CTAs per SM, cuDNN's grid shape: 256 CTAs of 4 warps at 8 x 32k and 32 x 8k)
# against 8: 8 x 8k 96.1 / 94.9 us, 8 x 32k 357.1 / 357.3, 32 x 8k 354.3 / 352.9, 8 x 128k 1401.0 / 1391.5,
# 1 x 128k 186.1 / 181.7 (geomean 0.993); plain loads (regs 1) against the evict-first policy (6): geomean
# 0.999 over the same 7 cells (worst 0.994). Both stay. Built on wip/dec14 before the batch-1 options were
# merged and not merged (rounds 1-3, logs/session23_dec14/r1..r3), each against this default: an L2
# prefetch of the block 1 / 2 / 4 further down the split (8 x 32k 370.1 / 373.4 / 389.1 against 357.3,
# cuDNN 353.1; ncu 87.0-87.5% of DRAM peak against 90.1%, cuDNN 91.1%), per-warp block claims from the
# group's counter (commit bcbf873; 8 x 32k 360.5 / 360.1, 8 x 8k 97.4 / 96.0, 1 x 128k 180.3 and 180.1
# against 181.4 and 182.2, cuDNN 180.0 / 179.6; more CTAs 3-14% slower; ncu: the SMs' active cycles
# 591.9k average / 643.6k busiest, as without) and each split's run started at a block rotated by the
# group's index (commit 91f1a06; geomean 0.986, 8 x 32k 362.1 / 358.0).
REGS_WARPS = 8
# regs_prefetch (decode_splitkv_regs' kEarlyPrefetch): the split's first block of a full row
# prefetched into L1 before cache_seqlens arrives (contiguous caches). The heuristic's choice
# (REGS_PREFETCH_DEFAULT, with regs): off, not yet timed.
REGS_PREFETCH_DEFAULT = False
REGS_VALUES = (0, 1, 2, 3, 4, 5, 6, 7)
# regs_ahead (decode_splitkv_regs' kAhead): with each block's register loads a warp prefetches the
# rows of the block regs_ahead iterations later (contiguous whole blocks), into L2, or into L1 with
# regs_ahead_l1 (kAheadL1): 0 none, or 2..8.
REGS_AHEAD_VALUES = (0, 2, 3, 4, 5, 6, 7, 8)
# regs_order (decode_splitkv_regs' kOrder): a split's blocks, 0 one run from the top down, 1
# interleaved (split s: blocks s, s + splits, ...), 2 as 1 with the first block's loads issued
# before cache_seqlens arrives (contiguous caches without cache_batch_idx, leftpad or a left window).
REGS_ORDER_VALUES = (0, 1, 2)
REGS_AHEAD_DEFAULT = 0          # every regs call's regs_ahead (0: none; the batch-1 rules below may set it)
REGS_AHEAD_L1_DEFAULT = False
REGS_ORDER_DEFAULT = 0          # every regs call's regs_order (tests; the batch-1 rules may set it)
# Batch-1 rules of the regs kernel (sm_90, contiguous caches, one batch row): the first entry
# (max keys, {DecodeConfig field: value}) whose max keys covers the call's seqlen_k (the cache's
# capacity) replaces those fields of the heuristic's regs config (regs_options; REGS_BATCH1 False:
# none). Measured on one H100 80GB HBM3 (session 23 round 2, tests/decode_b1_timing.py, bf16 d 128
# 32:8 heads, CUDA graphs, 7 shuffled repeats, SDPA cuDNN in the same process;
# results/NVIDIA_H100_80GB_HBM3/logs/session23_dec13/r2), us, the early L1 prefetch of the split's
# first 3 blocks (regs_prefetch, regs_prefetch_blocks 3) / 2 blocks / 1 block / the heuristic without
# the rule / cuDNN: 1 x 32k 46.70 / 47.65 / 48.91 / 50.44 / 47.80 (2.87 TB/s), 1 x 64k 89.81 / 90.50 /
# 91.79 / 93.28 / 90.98, 1 x 128k 177.64 / 178.18 / 179.90 / 180.47 / 177.46. Up to 8k keys (4 blocks
# a split) the prefetch loses where the cache stays in L2 between calls (1 x 8k graph replays: 3
# blocks 14.44, 1 block 14.08, none 13.40, plain loads 13.30, cuDNN 11.85 us) and wins only where it
# does not (4 caches in turn: 4 warps with 2 blocks 17.86, none 19.11, cuDNN 17.86): no rule there.
# The regs_ahead prefetches (L2 or L1, 2-3 blocks ahead all along) and the evict-last hint (regs 7)
# lost from 32k keys (round 1: 1 x 32k 56.9-58.9 against 52.2 us). Round 3 (r3, the heuristic with
# the rule / without / cuDNN): 1 x 16k 27.10 / 30.94 / 29.71, 1 x 32k 48.50 / 52.39 / 51.51, 1 x 64k
# 91.86 / 95.36 / 93.73, 1 x 128k 179.00 / 182.09 / 180.12 us. At 4k and 8k keys plain loads (regs 1)
# tie or win in graph replays (1 x 4k 10.73 against 11.76, 1 x 8k 13.49 against 13.61) but lose with
# 4 caches in turn (1 x 8k 20.05 against 19.54): not taken.
REGS_BATCH1 = True
# Session 25 (dec16, logs/session25_dec16/r3, tests/decode_paged_timing.py), the top-down prefetch / the
# interleaved order (regs_order 1) with its first 3 blocks prefetched (see REGS_SHAPE_RULES: its blocks do not
# depend on the row's length) / cuDNN, us: 1 x 32k 47.90 / 47.77 / 50.76, 1 x 64k 91.12 / 91.00 / 93.87,
# 1 x 128k 179.02 / 177.43 / 179.82: so the interleaved one.
# Session 27 (dec18, logs/session27_dec18/r2, r3; H100): up to 8k keys the separate combine kernel, launched as a
# programmatic dependent (pdl 1: its launch overlaps the main kernel) and loading its first 16 partial Os before
# the LSEs (early_merge), against the fused merge: the fused merge's last CTA runs its count and two L2 round trips
# while the other SMs sit idle (1 x 8k: 13.17 us for the fused kernel against 9.81 + 2.61 for main + combine).
# Round 3 (decode_b1_timing, one process, 9 shuffled rounds), us, this entry / without early_merge / without pdl /
# pdl 2 / the fused merge (before) / cuDNN: 1 x 8k 12.35 / 12.68 / 12.85 / 12.49 / 13.31 / 11.96, 1 x 4k 10.05 /
# 10.34 / 10.75 / 10.17 / 10.99 / 10.54; next to a 4096 x 4096 projection (decode's share of a step) 24.52 against
# 25.21 before, cuDNN 23.77; eager host time (b 1, 256 keys, pdl's cuLaunchKernelEx) 1.01x cuDNN's (median 1.03).
# At 1 x 16k the fused merge stays ahead (round 2: 27.36 against 28.36 with pdl). The H200 is not measured.
# Session 28 (dec20, logs/session28_dec20/r2, decode_b1_timing, one process, 9 shuffled rounds, H100): the entry also
# takes the interleaved order with the split's first block loaded before the row's length is read, and Q with it
# (regs_order 2, regs_spec 1: kSpec; regs_order 2 alone left those loads behind the length's round trip in the
# SASS), us, 1 x 8k / 1 x 4k: regs_spec 1 11.52 / 9.36, regs_spec 2 (addresses before pdl's wait) 11.67 / 9.37,
# regs_order 2 without kSpec 12.54 / 10.20, the session-27 entry 12.46 / 9.93, cuDNN 11.94 / 10.19 (1.036x / 1.089x
# against 0.958x / 1.026x); the early L1 prefetch of the next block(s) on top lost (12.48, 14.23 at 8k).
REGS_BATCH1_RULES: tuple = ((8192, {"fused_combine": False, "light_fence": False, "early_merge": True, "pdl": 1,
                                    "regs_order": 2, "regs_spec": 1}),
                            (1 << 31, {"regs_order": 1, "regs_prefetch": True, "regs_prefetch_blocks": 3}))
# The paged batch-1 calls' counterpart of REGS_BATCH1_RULES (regs_options; page tables and prefetch still come
# from REGS_SHAPE_RULES / REGS_PAGE_TABLE_DEFAULT / REGS_PAGED_BATCH1_PREFETCH): one batch row of at most 8192
# cached keys in pages runs the separate combine with its early partial-O loads, launched as a programmatic
# dependent, as the contiguous call does. Session 27 (lead), one H100 80GB HBM3, tests/decode_paged_timing.py,
# logs/session27_lead/r5: see the measurements there; without it page 16 at 1 x 8k was 1.10-1.16x the
# contiguous call's time once the contiguous call took this rule (issue 13: paged within 10%).
# Sessions 28-29: early first-block loads for pages lost (not merged; branches wip/dec22, wip/dec23). dec22 (one H100,
# logs/session28_dec22/r1, decode_paged_timing 1 x 8k, us): page id, then Q and the block, then the length: page 16
# 13.95 / 13.76 against this entry's 13.16 / 12.98. dec23 (one NVIDIA H200, results/NVIDIA_H200/logs/session29_dec23,
# two rounds x two processes): id, length and staged table row issued together before any K/V load (SASS-checked):
# page 16 13.36-13.60 against this entry's 12.68-12.84, page 256 13.19-13.53 against 12.42-12.58 (contiguous
# 11.08-11.26). ncu: the gap is the paged kernel's steady K/V stream (same DRAM bytes, lower throughput), ~0.55 us of
# it the contiguous call's faster start.
# dec25 (session 29, one NVIDIA H200, results/NVIDIA_H200/logs/session29_dec25/r1, the existing knobs, two processes,
# us, page 16 / page 256, this entry 12.74, 12.67 / 12.43, 12.36, contiguous 11.13, 11.04): splits x8 / x24 / x32,
# 4 or 16 warps, the fused combine, regs_order 1, the staged table's L1 prefetch, hints 2 and 5 and pdl 0 all tie or
# lose. pdl 3 wins at page 16 only (12.58, 12.48; its L2 prefetch is skipped for paged caches: the same run-time work)
# and loses at page 256 (12.55, 12.49). A device rule cannot match on page size, so nothing ships.
# dec26 (session 30, one NVIDIA H200, results/NVIDIA_H200/logs/session30_dec26): the gap is the paged code path, not
# the pages' order (r2: a table in order, the contiguous call's very addresses, 12.54 / 12.44 us against 11.80 / 11.71
# for the contiguous cache on this kernel and order); a per-warp window of page ids (block 1's loads right after block
# 0's) lost at both pages (r1: 13.00 / 12.84 at page 16, 13.01 / 12.94 at 256). The entry takes regs_page_shift (a
# power-of-two page's index by a shift; call_config drops it at other page sizes): r4, two processes, us, with / without
# / users' call before, contiguous: page 16 12.71, 12.49 / 12.96, 12.82 / 13.22, 12.62; page 256 12.53, 12.31 / 12.57,
# 12.41 / 12.62, 12.62; contiguous 11.27, 11.06 (1.127-1.130x and 1.111-1.113x; the H100 is not measured).
# dec28 (session 31, results/NVIDIA_H200/logs/session31_dec28): the sm_90a SASS gives the paged kernel's global page-id
# reads the K/V loads' scoreboard (no DEPBAR counts), so each block's id read waited for the block issued before it and
# the next block's math for the id read. regs_page_table 2 (the whole table row staged, every id from shared memory;
# rpt 1's global fallback for ids outside the slice kept that wait) won at both pages, r1, two processes, us, against the
# users' call (regs_page_table 0 on the H200), contiguous 11.12, 11.27: page 16 12.07, 12.22 against 12.55, 12.70 (1.085x,
# 1.084x); page 256 12.05, 12.13 against 12.34, 12.48 (1.083x, 1.076x). The H200's table takes it as a device rule (its
# paged rule turns regs_page_table off; the H100 is not measured, so this entry stays); r2, users' calls: 1.068-1.080x
# at 1 x 8k, 1.057-1.071x at 1 x 4k. It loses at 1 x 32k and 8 x 8k (r3: 0.2-3.2 us), so the rule stops at 8k keys.
REGS_BATCH1_PAGED_RULES: tuple = ((8192, {"fused_combine": False, "light_fence": False, "early_merge": True, "pdl": 1,
                                          "regs_page_shift": 1}),)
# The batch-1 load hint (regs_options, REGS_BATCH1): a call of one batch row, contiguous or paged, whose
# cache holds at most max_keys keys runs the first (max_keys, regs) entry's hint instead of REGS_DEFAULT,
# where no device rule sets regs. The figures above at 8k keys compared the hints as variants of one
# process, whose impls read the same cache: each one's L2 policy changes what the next finds in L2
# (session 24, dec15, logs/session24_dec15/r2, tests/decode_bench_gap.py: the default right after a
# plain-load or evict-last variant 13.3-14.4 us, after SDPA or itself 15.4-16.2). One hint per process
# (logs/session24_dec15/r3, decode_b1_timing.py --switch REGS_DEFAULT=N), 1 x 8k in graph
# replays of one cache, us, evict-first (6) / plain (1) / evict-last (7) / cuDNN: 15.83 / 13.32 /
# 13.21 / 11.87-12.02; 4 caches in turn: 19.58 / 20.07 / 20.10 / 18.03-18.51; 1 x 4k 10.50 / 10.40
# / 10.47 / 9.60-9.63; 1 x 16k 27.06 / 31.89 / 31.89 (the early prefetch's rule, above). Plain loads
# keep the cache's lines in L2 for the next call (as cuDNN's do), evict-first gives them up. The
# bench's batch-1 cells (logs/session24_dec15/r4, tests/decode_bench_gap.py --bench, two runs per
# process), us, before / with this rule / cuDNN: 1 x 8k 16.80, 15.80 / 13.64, 13.64 / 12.21-12.34, page
# 256 17.20, 16.71 / 14.24, 14.27; 1 x 4k 10.83, 10.80 / 10.78, 10.77 / 9.90-10.03. Page 16 (under
# TMA_PAGED_MAX_PAGE) stays on the regs kernel for these calls, not the Hopper loop
# (REGS_PAGED_TMA_MAX_KEYS): 1 x 8k 14.70, 15.10 against 15.88, 16.02; 1 x 4k 11.36, 11.39 against
# 11.83, 11.82. H200 (results/NVIDIA_H200/logs/session24_lead/callB, one setting per process, two
# passes), us, with / without: 1 x 8k 13.21, 13.22 / 13.87, 13.99 (cuDNN 11.5-11.9); bench 1 x 8k 13.2,
# 13.2 / 14.2, 14.0, page 16 14.3, 14.5 / 15.1, 14.8; cold 17.15, 17.25 / 17.09, 17.06: so by arch.
REGS_BATCH1_HINT: tuple = ((8192, 1),)


# Batch-1 cluster rules (sm_90, contiguous caches, one batch row): the first (max_keys, cluster)
# entry whose max_keys covers the problem's cached keys sets regs_cluster = cluster (0: none), the
# splits of each KV head as one cluster merged through distributed shared memory (no fused combine),
# where the groups' CTAs (KV heads x row blocks x cluster) are at most REGS_CLUSTER_MAX_CTAS.
# None: no cluster measured faster on the H100 (session 24, dec15, logs/session24_dec15/r2 and r3,
# tests/decode_b1_timing.py, bf16 d 128 32:8 heads, the evict-first hint throughout, us). 8 warps (one
# CTA per SM, 245 registers): only 7 clusters of 16 are resident at once (cuOccupancyMaxActiveClusters;
# 15 of 8, tests/decode_cluster_probe.py), so 1 x 8k's 8 clusters of 16 run in two waves: 23.02 against
# the fused combine's 13.80; clusters of 8 (8 splits, 64 CTAs) 17.32. 4 warps (14 clusters of 16 fit):
# 1 x 8k 18.61 against 16.88 for the same 4-warp grid with the fused combine (the 8-warp default 15.64,
# cuDNN 11.89), 1 x 4k 12.23 / 10.37, 1 x 16k 31.08 / 28.68, 4 caches in turn 20.66 / 19.42.
REGS_CLUSTER_RULES: tuple = ()
REGS_CLUSTER_MAX_CTAS = 128
REGS_CLUSTER_DEFAULT = 0   # every regs call's regs_cluster (tests: any batch, paged too; 0: the rules above)
# Pairs (DecodeSplitKV.pair_cluster, applied per call once the split count is known): a chosen regs call of
# batch >= 2 whose split rule gives exactly 2 splits (8 x 8 KV heads on 132 SMs) runs them as one cluster of 2
# CTAs merged through distributed shared memory instead of the fused combine's partials, count and merge in
# global memory. REGS_CLUSTER_PAIRS: contiguous caches, REGS_CLUSTER_PAIRS_PAGED: paged ones. H100 80GB HBM3,
# session 27 (dec19; logs/session27_dec19/r1, r2; bf16 d 128 32:8 heads, CUDA graphs of 20 calls, 7 shuffled
# rounds, SDPA in the same process), us, pairs / fused combine / SDPA flash / cuDNN: tests/decode_b1_timing.py,
# 8 x 8k 89.72 / 91.58 / 95.65 / 94.51, 8 x 32k 349.57 / 351.23 / 351.03 / 353.51 (round 1: 349.17 / 352.13 /
# 350.69 / 354.32), 8 x 128k 1385.28 / 1404.13 / 1388.67 / 1402.72 (torch.profiler, per call: 348.3 against
# 349.9 us busy at 8 x 32k, 88.8 / 90.6 at 8 x 8k); tests/decode_paged_timing.py at 8 x 32k: contiguous 349.31 /
# 352.17, page 16 358.61 / 359.80, page 256 352.79 / 353.36 (r3, 9 rounds: 8 x 32k contiguous 349.93 / 352.02,
# page 16 359.10 / 360.60, page 256 353.48 / 354.82; 8 x 8k 89.46 / 91.13, 93.63 / 95.12, 92.67 / 94.24; the
# bench, r3: 8 x 32k 351.3 against flash 350.6 and cuDNN 354.3). 32 x 8k (1 split) is not paired (2 splits as a
# cluster there: 355.65 against 349.89); 4 warps x 4 splits as clusters of 4 (256 CTAs) lost everywhere
# (8 x 32k 422.6).
REGS_CLUSTER_PAIRS = True
REGS_CLUSTER_PAIRS_PAGED = True


def batch1_hint(problem: Problem) -> int:
    """The load hint (regs) REGS_BATCH1_HINT gives ``problem`` (one batch row within an entry's keys),
    else 0."""
    if REGS_BATCH1 and problem.batch == 1:
        for max_keys, regs in REGS_BATCH1_HINT:
            if problem.seqlen_k <= max_keys:
                return regs
    return 0


def pdl_for(problem: Problem) -> int:
    """The pdl a regs call of ``problem`` gets: the first PDL_RULES entry (max batch, max keys per row, pdl)
    that covers it, else PDL_DEFAULT."""
    for max_batch, max_keys, pdl in PDL_RULES:
        if problem.batch <= max_batch and problem.seqlen_k <= max_keys:
            return pdl
    return PDL_DEFAULT


def regs_options(cfg, problem: Problem, hint: bool = True):
    """The heuristic's regs config ``cfg`` with REGS_AHEAD_DEFAULT, REGS_AHEAD_L1_DEFAULT and
    REGS_ORDER_DEFAULT and, for a batch-1 ``problem``, the first REGS_BATCH1_HINT entry that covers its
    keys (``hint``: no device rule sets the hint), for a batch-1 contiguous one the first
    REGS_BATCH1_RULES entry that does, the first REGS_SHAPE_RULES entry that matches, for a paged one
    REGS_PAGE_TABLE_DEFAULT (and at batch 1 the first REGS_PAGED_BATCH1_PREFETCH entry that covers its
    keys), for a contiguous one the first REGS_STAGED_RULES entry that covers it (REGS_STAGED_DEFAULT: every
    call, paged too), and the first REGS_CLUSTER_RULES entry that does."""
    if REGS_AHEAD_DEFAULT or REGS_AHEAD_L1_DEFAULT or REGS_ORDER_DEFAULT:
        cfg = cfg.replace(regs_ahead=REGS_AHEAD_DEFAULT, regs_ahead_l1=REGS_AHEAD_L1_DEFAULT, regs_order=REGS_ORDER_DEFAULT)
    if hint and batch1_hint(problem):
        cfg = cfg.replace(regs=batch1_hint(problem))
    if REGS_BATCH1 and problem.batch == 1:
        for max_keys, fields in (REGS_BATCH1_PAGED_RULES if "paged_kv" in problem.features else REGS_BATCH1_RULES):
            if problem.seqlen_k <= max_keys:
                cfg = cfg.replace(**fields)
                break
    paged = "paged_kv" in problem.features
    for rule_paged, (lo_b, hi_b), (lo_k, hi_k), fields in REGS_SHAPE_RULES:
        if (rule_paged == paged and lo_b <= problem.batch <= hi_b and lo_k <= problem.seqlen_k
                and (hi_k is None or problem.seqlen_k <= hi_k) and (paged or problem.batch > 1 or not REGS_BATCH1)):
            cfg = cfg.replace(**fields)
            break
    if REGS_PAGE_TABLE_DEFAULT and paged:
        cfg = cfg.replace(regs_page_table=REGS_PAGE_TABLE_DEFAULT)
        for max_keys, blocks in REGS_PAGED_BATCH1_PREFETCH if problem.batch == 1 else ():
            if problem.seqlen_k <= max_keys:
                if blocks:
                    cfg = cfg.replace(regs_prefetch=True, regs_prefetch_blocks=blocks)
                break
    if not (cfg.regs_ahead or cfg.regs_order == 2):   # see REGS_STAGED_RULES
        if REGS_STAGED_DEFAULT:
            cfg = cfg.replace(regs_staged=REGS_STAGED_DEFAULT)
        for max_batch, max_keys, fields in () if paged or not REGS_STAGED else REGS_STAGED_RULES:
            if problem.batch <= max_batch and problem.seqlen_k <= max_keys:
                cfg = cfg.replace(**fields)
                break
    if REGS_SPEC_DEFAULT and cfg.regs_order == 2:
        cfg = cfg.replace(regs_spec=REGS_SPEC_DEFAULT)
    if REGS_CLUSTER_DEFAULT and cfg.head_dim % (4 * REGS_CLUSTER_DEFAULT) == 0:
        return cfg.replace(regs_cluster=REGS_CLUSTER_DEFAULT, fused_combine=False, light_fence=False, splits=0,
                           regs_staged=0, early_merge=False, pdl=0)
    if problem.batch == 1 and "paged_kv" not in problem.features:
        for max_keys, cluster in REGS_CLUSTER_RULES:
            if problem.seqlen_k <= max_keys:
                if cluster and problem.nheads_kv * row_blocks(cfg, problem) * cluster <= REGS_CLUSTER_MAX_CTAS:
                    cfg = cfg.replace(regs_cluster=cluster, fused_combine=False, light_fence=False, splits=0,
                                      regs_staged=0, early_merge=False, pdl=0)
                break
    return cfg


# regs_cluster (decode_splitkv_regs' kCluster): the splits of one (batch, KV head, row block)
# as one thread-block cluster of that many CTAs (the split count), merged through distributed shared
# memory (no fused combine, no combine launch; launched with that cluster dimension, cuflash.launch.
# LaunchEx). 16 is a non-portable cluster size (the kernel's
# CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED is set when it loads: kernel_attributes).
REGS_CLUSTER_VALUES = (0, 2, 4, 8, 16)
# regs_staged (decode_splitkv_regs' kStaged; contiguous caches): past the two register sets, each warp keeps
# this many more of its K/V blocks in flight in its own shared-memory ring by cp.async (a cuDNN-like depth:
# at 1 x 8k a warp's 4 blocks are all requested at the kernel's start); paged caches run the plain loop. Off: on
# the H100 (session 27, dec18, logs/session27_dec18/r2, decode_b1_timing.py) it lost everywhere, us, main kernel
# at 1 x 8k 12.37 (depth 1) / 13.20 (depth 2) against 9.90 without; graph replays 1 x 8k 15.29 / 16.23 against
# 12.98 (8 warps, separate combine), 1 x 16k 38.29 / 38.80 against 27.31, 4 warps x 32 splits 16.92 at 1 x 8k.
REGS_STAGED_VALUES = (0, 1, 2, 3, 4)
REGS_STAGED_DEFAULT = 0    # every regs call's regs_staged (tests: paged calls too, which run the plain loop)
# Rules of the staged ring (regs_options; contiguous caches without regs_ahead or regs_order 2): the first
# (max batch, max keys, {DecodeConfig field: value}) entry that covers the call replaces those fields, e.g.
# {"warps": 4, "regs_staged": 2}: cuDNN's grid at 1 x 8k (num_splits_for takes the co-resident model for a
# staged config: two 4-warp CTAs per SM, 32 splits of 256 keys at 8 KV heads on 132 SMs).
REGS_STAGED_RULES: tuple = ()
# regs_spec (decode_splitkv_regs' kSpec; regs_order 2): the early loads of the split's first block, then Q's, are
# issued before cache_seqlens is read, and that read is kept after them (an ordered load): without it the compiler
# schedules the length's load and the split's range (its divisions) above regs_order 2's early loads, which then
# wait for the length's round trip as the plain ones do (sm_90a SASS of the 1 x 8k config, session 28).
# REGS_SPEC_DEFAULT: every regs call of regs_order 2 (after the rules; tests), 0: none.
REGS_SPEC_DEFAULT = 0
# regs_page_shift (decode_splitkv_regs' kPageShift, paged caches): the page size is a power of two, so a position's
# page index is a shift, not a signed division by the run-time page size (call_config drops it, or for a given
# config raises, at other page sizes). Session 30 (dec26, results/NVIDIA_H200/logs/session30_dec26): with the very
# addresses of the contiguous call (page 256, the table in order) the paged split kernel ran 0.7 us longer (ncu: more
# issued instructions and short-scoreboard stalls, the divisions' reciprocals among them).
REGS_PAGE_SHIFT_DEFAULT = 0     # every paged regs call's regs_page_shift where its page size allows (tests; 0: none)
REGS_STAGED = True         # REGS_STAGED_RULES on (False: none; decode_b1_timing.py's --variant "old REGS_STAGED=0")
# pdl (sm_90, the regs kernel): programmatic dependent launch. The plan launches the call's kernels with
# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuflash.launch.LaunchEx), so each may be scheduled
# before the stream's previous kernel has finished; each waits for it (griddepcontrol.wait) before its first
# global read or write. 1: the kernel lets its own successor be scheduled right after that wait, 2: after its
# K/V loop, 3: as 1, with the split's first block(s) prefetched into L2 before the wait even without regs_prefetch
# (kPdl in decode_splitkv_regs; the append and combine kernels wait and trigger at their start).
# PDL_DEFAULT: every regs call's pdl (0: off), PDL_RULES: the first (max batch, max keys per row, pdl) entry
# that covers a regs call (before PDL_DEFAULT). H100, session 26 (logs/session26_dec17, bf16 d 128 32:8 heads,
# CUDA graphs of 20 back-to-back calls, tests/decode_b1_timing.py, us, heuristic / pdl1 / pdl2 / cuDNN): 1 x 4k
# 11.17 / 10.73 / 10.77 / 10.86, 1 x 8k 13.35 / 13.71 / 13.48 / 11.96 (r2, 9 rounds: 13.53 / 13.67 / pdl3 13.35 /
# 12.00), 1 x 16k 27.56 / 26.15 / 26.28, 1 x 32k 48.47 / 47.65 / 47.80, 1 x 64k 91.00 / 91.35 / 90.28, 1 x 128k
# 177.82 / 178.85 / 178.34, 8 x 8k 92.29 / 92.23 / 91.41, 8 x 32k 355.25 / 355.73 / 355.16, 32 x 8k 351.70 / 354.64 /
# 354.90. The graphs' idle time between calls is 0.3-0.5 us (torch.profiler), all PDL can hide; next to a
# non-PDL neighbour (a decode step's x @ W of 4096 x 4096, tests/decode_pdl_neighbour_timing.py) pdl1 gained
# nothing (1 x 8k 26.03 against 26.10 us of decode per step) or lost (1 x 16k 34.66 / 32.57, 8 x 32k 359.87 /
# 358.34). So off: a back-to-back decode graph is not how a model calls it.
PDL_VALUES = (0, 1, 2, 3)
PDL_DEFAULT = 0
PDL_RULES: tuple = ()
# regs_page_table (decode_splitkv_regs' kPageTable, paged caches): the page ids a CTA reads staged in
# shared memory once (REGS_PAGE_IDS of them: a table row of at most that many pages whole, before
# cache_seqlens arrives; else the split's top slice), so no block's K/V loads wait on a global table
# read; with regs_prefetch the rows of the regs_prefetch_blocks blocks after the first two are
# prefetched into L1 once the ids are staged. The heuristic's choice: REGS_PAGE_TABLE_DEFAULT (0: off).
REGS_PAGE_IDS = 2048            # kPageIds in decode_splitkv_regs
REGS_PAGE_TABLE_DEFAULT = 0     # every paged regs call's regs_page_table (tests; REGS_SHAPE_RULES set it by shape)
# With REGS_PAGE_TABLE_DEFAULT, batch-1 paged calls: the first (max_keys, blocks) entry whose max_keys
# covers the problem's cached keys sets regs_prefetch with regs_prefetch_blocks = blocks (0: none).
REGS_PAGED_BATCH1_PREFETCH: tuple = ()
# Rules of the regs kernel by shape (sm_90, after REGS_BATCH1_RULES): the first entry (paged, (min batch,
# max batch), (min keys, max keys or None), {DecodeConfig field: value}) that matches the problem (paged
# cache or not, its batch, its cached keys) replaces those fields (regs_options; the contiguous batch-1
# calls keep REGS_BATCH1_RULES). The paged rules' page table alone, without the prefetch, is kept for pages
# under TMA_PAGED_MAX_PAGE keys only (call_config). Measured on one H100 80GB HBM3 (session 25, dec16,
# tests/decode_paged_timing.py, bf16 d 128 32:8 heads, CUDA graphs, 5-7 shuffled rounds, SDPA cuDNN and
# flash and the contiguous call in the same process, one L2 hint per process;
# results/NVIDIA_H100_80GB_HBM3/logs/session25_dec16/r1, r2), us:
#  - paged, batch 1, page 16 / 256, today's / the page table / with the prefetch of 3 blocks (contiguous
#    in the same process): 1 x 8k 14.31, 14.47 / 14.14, 14.18 / 14.65-14.92 (13.30, 13.37), page 256
#    13.88, 13.87 / 14.05 / 14.95 (so no table at 1 x 8k page 256); 1 x 16k 30.92 / 30.53 / 29.09
#    (26.99), page 256 30.56 / - / 29.27; 1 x 32k 52.64 / 52.94 / 51.24 (48.13), page 256 51.94 / 52.09 /
#    50.76; 1 x 64k 96.80 / 97.05 / 95.34 (90.96), page 256 94.58 / 94.94 / 93.65.
#  - paged, batch 8 (two processes), page 16 today's / the table with the prefetch: 8 x 8k 97.04, 96.76
#    / 95.22, 94.70; 8 x 32k 359.85, 359.62 / 359.24, 359.24; page 256 95.06, 94.57 / 93.75, 94.10 and
#    353.86, 353.89 / 354.14, 353.74.
#    Round 3 (r3), page 16 today's / the table with the prefetch (contiguous): 2 x 32k 96.70 / 94.95
#    (90.67), 4 x 16k 96.63 / 94.58 (90.61), 16 x 8k 181.46 / 179.94 (175.24), 32 x 8k 359.07 / 359.51,
#    64 x 8k 707.84 / 713.26 (page 256 700.32 / 703.14), 8 x 128k 1411.81 / 1431.30 (page 256 1400.80 /
#    1405.76): so batches 2-16 up to 32k keys.
#  - contiguous, batch 8 (two processes), today's / the early prefetch of 3 blocks (regs_prefetch) / the
#    interleaved block order with the early prefetch of its first 3 blocks (regs_order 1) / cuDNN /
#    flash: 8 x 8k 94.85, 94.36 / 91.29, 90.83 / 91.34, 90.84 / 93.83, 93.54 / 96.76, 96.58; 8 x 32k
#    355.39, 355.77 / 352.45, 352.60 / 350.25, 350.09 / 353.63, 354.04 / 349.87, 349.88. Rows at a
#    quarter of the capacity (8 x 32k, cache_seqlens 8192: the top-down prefetch reads a full row's
#    blocks): 94.69 / 94.17 / 90.79, so the interleaved order's (its first blocks are every long
#    enough row's). Round 3, today's / the interleaved prefetch / cuDNN / flash: 2 x 32k 94.58 / 90.67 /
#    93.43 / 99.75, 4 x 16k 94.74 / 90.61 / 93.46 / 98.01, 16 x 8k 178.44 / 175.24 / 173.97 / 179.83,
#    32 x 8k 352.70 / 348.78 / 350.60 / 399.34, 64 x 8k 700.31 / 697.07 / 695.81 / 801.06, 8 x 128k
#    1397.31 / 1396.86 / 1394.88 / 1387.17; with plain loads (regs 1) for every impl of the process
#    (8 x 32k) it gained nothing (356.20 / 355.69, cuDNN 353.22), so the evict-first hint stays.
REGS_SHAPE_RULES: tuple = (
    (True, (1, 1), (1, 8192), {"regs_page_table": 1}),
    (True, (1, 1), (8193, None), {"regs_page_table": 1, "regs_prefetch": True, "regs_prefetch_blocks": 3}),
    (True, (2, 16), (1, 32768), {"regs_page_table": 1, "regs_prefetch": True, "regs_prefetch_blocks": 3}),
    (False, (2, 64), (8192, None), {"regs_order": 1, "regs_prefetch": True, "regs_prefetch_blocks": 3}),
)
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
REGS_SPACE = (0,)
REGS_HEAD_DIMS = (64, 128)
REGS_THREAD_REGISTERS = 256   # ptxas: 236 at 8 warps x 16 keys, d 128 (nvcc 13.0, sm_90a); the residency model's
REGISTER_FILE = 65536         # 32-bit registers per SM

@dataclasses.dataclass(frozen=True, order=True)
class DecodeConfig(KernelConfig):
    """One decode_splitkv kernel set and its split rule.

    warps:    warps per CTA; the CTA's K/V block is warps · warp_n keys
    warp_n:   keys per warp per block (multiple of 16): each warp runs S = Q K_wᵀ, O += P V_w
    stages:   K/V blocks resident in shared memory (>= 2)
    m_tiles:  16-row tiles of packed query rows (nheads / nheads_kv · seqlen_q) per CTA (1, 2)
    split_cost: split rule (not a kernel parameter): the fixed cost of one split (its prologue,
              its partial's write, its share of the combine) in K/V blocks, which
              num_splits=0 weighs against wave quantization (``num_splits_for``)
    splits:   the number of splits a plan launches (0: the heuristic's, num_splits_for)
    head_dim: compile-time head dim (multiple of 16, <= 256)
    dtype:    "bf16" or "fp16"
    causal:   the call's flag (masks are run-time parameters of the kernel: not a template one)
    fused_combine: (splits > 1) no decode_combine launch: the last CTA of each (batch, KV head,
              row block) to finish merges the group's splits (an atomic count per group in a
              persistent, zeroed int32 buffer that the call shape's plan owns, ``counters``)
    page_prefetch: paged caches read a K/V block's page ids from block_table one block ahead
              (into registers) instead of once per key row right before its cp.async
    l2_prefetch: 0, 64, 128 or 256: the cp.async loop's whole K/V blocks load with an L2
              prefetch-size hint of that many bytes (``cp.async...L2::256B``: on a miss the L2
              fetches the whole aligned segment; a d 128 bf16 key row is 256 bytes); 0: no hint
    page_gather: paged caches: each thread reads the page ids of all its rows of a K/V block from
              block_table before the block's first cp.async (False: one table read right before
              each row's copy, a dependent round trip per row pass; page_prefetch, if set, wins)
    warp_loads: the cp.async loop's K/V rows are loaded by the warp that reads them (each warp its
              warp_n rows of every block), so the ring needs no CTA barrier per block and the
              warps stream independently; False: the CTA loads each block together
    lean:     the cp.async loop's warps keep Q's mma fragments in registers (read once per CTA, not
              per block) and rescale O only when a row's running max grew in the block (one row
              tile up to d 128: the fragments' registers)
    bulk:     (sm_90) the cp.async loop's whole K/V blocks arrive by one cp.async.bulk per key row
              on a per-slot mbarrier (1), with an L2 evict-first policy (2); 0: 16-byte cp.asyncs.
              No warp_loads, page_prefetch or page_gather with it
    early_merge: (fused_combine) the merging CTA issues its first partial-O loads before the LSE
              loads (the two L2 round trips overlap); with regs (no fused_combine: its fused merge always
              does) the separate decode_combine kernel does so (kEarly)
    ring_fill: (the cp.async loop) 0: the prologue loads stages - 1 K/V blocks, each iteration
              the next before O += P V; 1: the prologue fills every slot; 2: as 1, with each
              iteration's load issued before S (kernels_cu/decode_splitkv.cu, kRingFill)
    dynamic:  (ring_fill >= 1; no bulk, page_prefetch, warp_loads or tma) 0: each split one run of
              the row's K/V blocks; 1 (fused_combine): a group's splits claim its blocks one at a
              time from a counter (kept with the fused combine's, ``counters``); 2: split s takes
              the group's blocks s, s + splits, ... (kDynamic)
    stream:   (fused_combine; no other option of the loop) decode_splitkv_stream: every group's K/V
              blocks as one list in equal ranges over ``splits`` CTAs (the SMs' resident slots),
              a group's pieces merged by its last CTA; calls without a window (causal only at
              seqlen_q 1), at most STREAM_MAX_BATCH rows
    light_fence: (fused_combine, the split kernel) the finished splits' count without a fence per
              thread: the CTA barrier and thread 0's acq_rel atomic (kLightFence)
    regs_prefetch: (regs) before cache_seqlens is read, the rows of the split's first K/V block of a
              full row are prefetched into L1 (contiguous caches; kEarlyPrefetch)
    regs:     (0: off) decode_splitkv_regs: each warp loads its K/V rows straight into registers
              (16-byte loads, the next block's in flight during this one's math) and runs Sᵀ =
              K Qᵀ, Oᵀ += Vᵀ Pᵀ (8 packed query rows per row tile: rows = 8 · m_tiles); the loads'
              cache hints: 1 none, 2 L1::no_allocate + L2::256B, 3 also an L2 evict-first policy,
              4 L1::no_allocate, 5 L2::256B, 6 the evict-first policy. fused_combine and
              light_fence as the split kernel; no other option; head dims 64 and 128 (the call's);
              warp_n · head_dim <= 2048; ``stages`` is not used
    regs_cluster: (regs; 0 none, 2, 4, 8 or 16) the splits of each (batch, KV head, row block) as one
              thread-block cluster of that many CTAs (the split count): each CTA keeps its split's O and
              LSE in shared memory and merges a slice of the head dim's columns from all of them through
              distributed shared memory (kCluster; no fused_combine or light_fence, no combine launch,
              no partials in global memory)
    pdl:      (regs, sm_90; 0 none) programmatic dependent launch: the plan's kernels launch with the
              programmatic-stream-serialization attribute and wait for the stream's previous kernel on the
              device (kPdl; PDL_DEFAULT): 1 the main kernel lets the next kernel be scheduled right after
              its wait, 2 after its K/V loop, 3 as 1 with the split's first block(s) prefetched into L2 before
              the wait without regs_prefetch too. No regs_cluster
    regs_staged: (regs; 0 none, 1..4) each warp's blocks after its first two stream by cp.async into a ring of
              that many K/V blocks in its shared memory, all requested at the start, and are read back into the
              register sets (kStaged; contiguous caches, the plain loop for paged ones). No regs_ahead,
              regs_order 2 or regs_cluster
    regs_page_table: (regs, paged caches; 0 none) the page ids a CTA reads staged in shared memory (kPageTable): 1 a
              table row of at most REGS_PAGE_IDS pages whole, a longer row's split slice (ids outside it read from
              block_table); 2 the whole row always, every id from shared memory (rows of at most REGS_PAGE_IDS
              pages: call_config falls back to 1 for a chosen config, raises naming block_table for a given one)
    regs_page_shift: (regs, paged caches of a power-of-two page size; 0 none) a position's page index by a shift
              instead of a division by the page size (kPageShift)
    regs_spec: (regs, regs_order 2; 0 none) regs_order 2's early loads of the split's first block, then Q's, are
              issued before cache_seqlens is read, and that read is kept after them (kSpec): without it the
              compiler schedules the length's load and the split's range above the early loads; 2: as 1, with
              those loads' addresses computed before pdl's wait for the previous kernel
    tma:      the Hopper loop (sm_90 only): one more warp, a producer, streams the K/V blocks by
              TMA into a ring of ``stages`` slots with full / empty mbarriers (all slots in flight),
              and the warps only compute; contiguous caches take one box of ``block_n`` keys per
              K (V) block, paged ones a box per page segment (``tma_box_rows``). Needs the real
              head dim to equal ``head_dim`` (the box carries no column mask), a page size that
              is a multiple of 16, no fused combine, page prefetch, l2_prefetch, warp_loads or
              page_gather
    """

    warps: int
    warp_n: int
    stages: int
    m_tiles: int
    split_cost: int
    head_dim: int
    dtype: str
    causal: bool
    splits: int = 0
    fused_combine: bool = False
    page_prefetch: bool = False
    tma: bool = False
    l2_prefetch: int = 0
    warp_loads: bool = False
    page_gather: bool = False
    lean: bool = False
    bulk: int = 0
    early_merge: bool = False
    ring_fill: int = 0
    dynamic: int = 0
    stream: bool = False
    light_fence: bool = False
    regs: int = 0
    regs_prefetch: bool = False
    regs_ahead: int = 0
    regs_ahead_l1: bool = False
    regs_order: int = 0
    regs_prefetch_blocks: int = 1
    regs_cluster: int = 0
    regs_page_table: int = 0
    pdl: int = 0
    regs_staged: int = 0
    regs_spec: int = 0
    regs_page_shift: int = 0

    family = "decode_splitkv"
    _what = "decode"

    @property
    def block_n(self) -> int:
        return self.warps * self.warp_n

    @property
    def rows(self) -> int:
        return (8 if self.regs else 16) * self.m_tiles

    @property
    def threads(self) -> int:
        """The warps, plus the producer warp of the Hopper loop (tma)."""
        return 32 * (self.warps + (1 if self.tma else 0))

    @property
    def name(self) -> str:
        split = f"_x{self.splits}" if self.splits else ""
        flags = (("_fc" if self.fused_combine else "") + ("_pp" if self.page_prefetch else "")
                 + ("_tma" if self.tma else "") + (f"_l2p{self.l2_prefetch}" if self.l2_prefetch else "")
                 + ("_wl" if self.warp_loads else "") + ("_pg" if self.page_gather else "")
                 + ("_ln" if self.lean else "") + (f"_bk{self.bulk}" if self.bulk else "")
                 + ("_em" if self.early_merge else "") + (f"_rf{self.ring_fill}" if self.ring_fill else "")
                 + ("_dyn" if self.dynamic == 1 else "_ilv" if self.dynamic == 2 else "")
                 + ("_stk" if self.stream else "") + ("_lf" if self.light_fence else "")
                 + (f"_rg{self.regs}" if self.regs else "") + ("_rpf" if self.regs_prefetch else "")
                 + (f"_ra{self.regs_ahead}" if self.regs_ahead else "") + ("l1" if self.regs_ahead_l1 else "")
                 + (f"_ro{self.regs_order}" if self.regs_order else "")
                 + (f"_pb{self.regs_prefetch_blocks}" if self.regs_prefetch_blocks != 1 else "")
                 + (f"_cl{self.regs_cluster}" if self.regs_cluster else "")
                 + (f"_rpt{self.regs_page_table}" if self.regs_page_table else "")
                 + (f"_pdl{self.pdl}" if self.pdl else "") + (f"_rst{self.regs_staged}" if self.regs_staged else "")
                 + (f"_rsp{self.regs_spec}" if self.regs_spec else "")
                 + ("_rps" if self.regs_page_shift else ""))
        return (f"decode_{self.dtype}_d{self.head_dim}_w{self.warps}_n{self.warp_n}_s{self.stages}"
                f"_m{self.m_tiles}_c{self.split_cost}{split}{flags}")

    @property
    def smem_bytes(self) -> int:
        """Q tile plus `stages` (K, V) blocks, rows padded by 8 elements (tma: plus the ring's
        full and empty mbarriers, 8 bytes each; bulk: one mbarrier per slot)."""
        if self.regs:   # the warps' merge (kMergePitch = head_dim + 4 words, m, l) and the merge flag
            # (regs_cluster: plus the split's normalized O and LSE, which the cluster's CTAs read)
            cluster = self.rows * (self.head_dim + 1) * 4 if self.regs_cluster else 0
            # (regs_page_table: plus the staged page ids, kPageIds of them)
            ids = 4 * REGS_PAGE_IDS if self.regs_page_table else 0
            # (regs_staged: plus each warp's ring of that many K/V blocks, 16 bytes per lane per load)
            chunks = self.warp_n // 16 * (2 * (self.head_dim // 32) + 4 * (self.head_dim // 64))
            staged = self.warps * self.regs_staged * chunks * 32 * 16
            return self.warps * self.rows * (self.head_dim + 6) * 4 + 16 + cluster + ids + staged
        tiles = (self.rows + 2 * self.stages * self.block_n) * (self.head_dim + 8) * 2
        if self.stream:   # a Q tile per ring slot, the per-row prefix
            return tiles + (self.stages - 1) * self.rows * (self.head_dim + 8) * 2 + 4 * STREAM_SMEM_INTS
        claims = 2 * self.stages * 4 if self.dynamic else 0   # the block ids' ring
        return tiles + (2 * self.stages * 8 if self.tma else self.stages * 8 if self.bulk else 0) + claims

    @property
    def accum_regs(self) -> int:
        return self.m_tiles * (self.head_dim + self.warp_n) // 2

    def kernel_name(self) -> str:
        flag = {True: "true", False: "false"}
        if self.regs:
            # the trailing options at their defaults are left out
            trailing = [flag[bool(self.regs_prefetch)], str(int(self.regs_ahead)), flag[bool(self.regs_ahead_l1)],
                        str(int(self.regs_order)), str(int(self.regs_prefetch_blocks)), str(int(self.regs_cluster)),
                        str(int(self.regs_page_table)), str(int(self.pdl)), str(int(self.regs_staged)),
                        str(int(self.regs_spec)), str(int(self.regs_page_shift))]
            defaults = ["false", "0", "false", "0", "1", "0", "0", "0", "0", "0", "0"]
            while trailing and trailing[-1] == defaults[len(trailing) - 1]:
                trailing.pop()
            return (f"cuflash::decode_splitkv_regs<{self.warps}, {self.warp_n}, {self.m_tiles}, {self.head_dim}, "
                    f"cuflash::{self.dtype}, {flag[self.fused_combine]}, {flag[self.light_fence]}, {self.regs - 1}"
                    + "".join(f", {x}" for x in trailing) + ">")
        if self.tma:  # the Hopper loop: its own kernel (a grid-constant DecodeTmaParams)
            return (f"cuflash::decode_splitkv_tma<{self.warps}, {self.warp_n}, {self.stages}, "
                    f"{self.m_tiles}, {self.head_dim}, cuflash::{self.dtype}>")
        if self.stream:
            return (f"cuflash::decode_splitkv_stream<{self.warps}, {self.warp_n}, {self.stages}, "
                    f"{self.m_tiles}, {self.head_dim}, cuflash::{self.dtype}, {int(self.l2_prefetch)}>")
        # the defaults (false, 0) of the trailing flags are left out
        trailing = [flag[self.page_gather], flag[self.lean], str(int(self.bulk)), flag[self.early_merge],
                    str(int(self.ring_fill)), str(int(self.dynamic)), flag[self.light_fence]]
        while trailing and trailing[-1] in ("false", "0"):
            trailing.pop()
        gather = "".join(f", {x}" for x in trailing)
        return (f"cuflash::decode_splitkv<{self.warps}, {self.warp_n}, {self.stages}, {self.m_tiles}, "
                f"{self.head_dim}, cuflash::{self.dtype}, {flag[self.fused_combine]}, "
                f"{flag[self.page_prefetch]}, {int(self.l2_prefetch)}, {flag[self.warp_loads]}{gather}>")

    def template_args(self) -> tuple:
        if self.regs:
            return (self.warps, self.warp_n, self.m_tiles, self.head_dim, self.dtype, bool(self.fused_combine),
                    bool(self.light_fence), self.regs - 1, bool(self.regs_prefetch), int(self.regs_ahead),
                    bool(self.regs_ahead_l1), int(self.regs_order), int(self.regs_prefetch_blocks), int(self.regs_cluster),
                    int(self.regs_page_table), int(self.pdl), int(self.regs_staged), int(self.regs_spec),
                    int(self.regs_page_shift))
        if self.stream:
            return (self.warps, self.warp_n, self.stages, self.m_tiles, self.head_dim, self.dtype,
                    int(self.l2_prefetch))
        if self.tma:
            return (self.warps, self.warp_n, self.stages, self.m_tiles, self.head_dim, self.dtype)
        return (self.warps, self.warp_n, self.stages, self.m_tiles, self.head_dim, self.dtype,
                bool(self.fused_combine), bool(self.page_prefetch), int(self.l2_prefetch),
                bool(self.warp_loads), bool(self.page_gather), bool(self.lean), int(self.bulk),
                bool(self.early_merge), int(self.ring_fill), int(self.dynamic), bool(self.light_fence))

    def _problems(self) -> list[str]:
        out = self._common_problems(MAX_HEAD_DIM)
        if self.warp_n <= 0 or self.warp_n % 16:
            out.append(f"warp_n must be a positive multiple of 16, got {self.warp_n}")
        if self.m_tiles not in (1, 2):
            out.append(f"m_tiles must be 1 or 2, got {self.m_tiles}")
        if self.split_cost < 0:
            out.append(f"split_cost must be >= 0, got {self.split_cost}")
        if self.l2_prefetch not in L2_PREFETCH_SIZES:
            out.append(f"l2_prefetch must be one of {L2_PREFETCH_SIZES} (bytes; 0: no hint), "
                       f"got {self.l2_prefetch}")
        if self.bulk not in BULK_VALUES:
            out.append(f"bulk must be one of {BULK_VALUES} (0: 16-byte cp.asyncs), got {self.bulk}")
        elif self.bulk and (self.tma or self.warp_loads or self.page_prefetch or self.page_gather):
            out.append("bulk: the bulk rows are the CTA's own loads of the cp.async loop: no tma, "
                       "warp_loads, page_prefetch or page_gather with it")
        if self.early_merge and (self.tma or not (self.fused_combine or self.regs)):
            out.append("early_merge: an option of the fused combine (fused_combine, no tma) or of the regs kernel's "
                       "separate combine")
        elif self.early_merge and self.regs and self.fused_combine:
            out.append("regs: early_merge is an option of the separate combine kernel (no fused_combine: the regs "
                       "kernel's fused merge always loads early)")
        if self.ring_fill not in RING_FILL_VALUES:
            out.append(f"ring_fill must be one of {RING_FILL_VALUES} (0: stages - 1 blocks ahead), "
                       f"got {self.ring_fill}")
        elif self.ring_fill and self.tma:
            out.append("ring_fill: an option of the cp.async loop (no tma)")
        if self.dynamic not in DYNAMIC_VALUES:
            out.append(f"dynamic must be one of {DYNAMIC_VALUES} (0: equal runs), got {self.dynamic}")
        elif self.dynamic and (not self.ring_fill or self.bulk or self.page_prefetch or self.warp_loads or self.tma
                               or (self.dynamic == 1 and not self.fused_combine)):
            out.append("dynamic: needs ring_fill >= 1 (and fused_combine for 1), and no bulk, page_prefetch, "
                       "warp_loads or tma")
        if self.light_fence and (self.tma or self.stream or not self.fused_combine):
            out.append("light_fence: an option of the split kernel's fused combine (fused_combine; the stream "
                       "kernel always counts so)")
        if self.regs_prefetch and not self.regs:
            out.append("regs_prefetch: an option of the regs kernel (regs)")
        if self.regs_ahead not in REGS_AHEAD_VALUES:
            out.append(f"regs_ahead must be one of {REGS_AHEAD_VALUES} (0: none), got {self.regs_ahead}")
        elif (self.regs_ahead or self.regs_ahead_l1) and not self.regs:
            out.append("regs_ahead, regs_ahead_l1: options of the regs kernel (regs)")
        elif self.regs_ahead_l1 and not self.regs_ahead:
            out.append("regs_ahead_l1: where regs_ahead's prefetches go (needs regs_ahead)")
        if self.regs_order not in REGS_ORDER_VALUES:
            out.append(f"regs_order must be one of {REGS_ORDER_VALUES}, got {self.regs_order}")
        elif self.regs_order and not self.regs:
            out.append("regs_order: an option of the regs kernel (regs)")
        if self.regs_prefetch_blocks not in (1, 2, 3):
            out.append(f"regs_prefetch_blocks must be 1, 2 or 3, got {self.regs_prefetch_blocks}")
        elif self.regs_prefetch_blocks != 1 and not self.regs_prefetch:
            out.append("regs_prefetch_blocks: how many blocks regs_prefetch prefetches (needs regs_prefetch)")
        if self.regs_cluster not in REGS_CLUSTER_VALUES:
            out.append(f"regs_cluster must be one of {REGS_CLUSTER_VALUES} (0: none), got {self.regs_cluster}")
        elif self.regs_cluster and (not self.regs or self.fused_combine or self.light_fence
                                    or self.splits not in (0, self.regs_cluster)):
            out.append(f"regs_cluster: the regs kernel's splits as one cluster of {self.regs_cluster} CTAs (regs; "
                       f"splits 0 or {self.regs_cluster}; it merges them itself: no fused_combine or light_fence)")
        elif self.regs_cluster and self.head_dim % (4 * self.regs_cluster):
            out.append(f"regs_cluster: each CTA merges head_dim / regs_cluster columns, a multiple of 4; got "
                       f"head_dim {self.head_dim} over {self.regs_cluster}")
        if self.regs_page_table not in (0, 1, 2):
            out.append(f"regs_page_table must be 0, 1 or 2, got {self.regs_page_table}")
        elif self.regs_page_table and not self.regs:
            out.append("regs_page_table: an option of the regs kernel (regs)")
        if self.pdl not in PDL_VALUES:
            out.append(f"pdl must be one of {PDL_VALUES} (0: off), got {self.pdl}")
        elif self.pdl and (not self.regs or self.regs_cluster):
            out.append("pdl: an option of the regs kernel (regs) without regs_cluster")
        if self.regs_staged not in REGS_STAGED_VALUES:
            out.append(f"regs_staged must be one of {REGS_STAGED_VALUES} (0: none), got {self.regs_staged}")
        elif self.regs_staged and (not self.regs or self.regs_ahead or self.regs_order == 2 or self.regs_cluster):
            out.append("regs_staged: an option of the regs kernel (regs) without regs_ahead, regs_order 2 or "
                       "regs_cluster")
        if self.regs_spec not in (0, 1, 2):
            out.append(f"regs_spec must be 0, 1 or 2, got {self.regs_spec}")
        elif self.regs_spec and (not self.regs or self.regs_order != 2):
            out.append("regs_spec: an option of the regs kernel's regs_order 2 (regs, regs_order 2)")
        if self.regs_page_shift not in (0, 1):
            out.append(f"regs_page_shift must be 0 or 1, got {self.regs_page_shift}")
        elif self.regs_page_shift and not self.regs:
            out.append("regs_page_shift: an option of the regs kernel (regs)")
        if self.regs not in REGS_VALUES:
            out.append(f"regs must be one of {REGS_VALUES} (0: off), got {self.regs}")
        elif self.regs:
            if (self.tma or self.bulk or self.page_prefetch or self.page_gather or self.warp_loads or self.lean
                    or self.ring_fill or self.dynamic or self.stream or self.l2_prefetch):
                out.append("regs: decode_splitkv_regs has fused_combine, light_fence and early_merge only (no tma, "
                           "bulk, page_prefetch, page_gather, warp_loads, lean, ring_fill, dynamic, stream or "
                           "l2_prefetch)")
            if self.head_dim not in REGS_HEAD_DIMS:
                out.append(f"regs: head_dim must be one of {REGS_HEAD_DIMS}, got {self.head_dim}")
            if self.warp_n * self.head_dim > 2048:
                out.append(f"regs: warp_n * head_dim must be <= 2048 (two register sets of K/V), "
                           f"got {self.warp_n * self.head_dim}")
            if self.m_tiles * self.head_dim > 128:
                out.append(f"regs: m_tiles * head_dim must be <= 128 (ptxas spills two row tiles at d 128: 255 "
                           f"registers, nvcc 13.0 sm_90a), got {self.m_tiles * self.head_dim}")
        if self.stream:
            if (not self.fused_combine or self.tma or self.bulk or self.page_prefetch or self.page_gather
                    or self.warp_loads or self.lean or self.ring_fill or self.dynamic):
                out.append("stream: needs fused_combine (its counters), and no tma, bulk, page_prefetch, "
                           "page_gather, warp_loads, lean, ring_fill or dynamic")
            if self.rows * (self.head_dim + 2) > self.warp_n * (self.head_dim + 8):
                out.append("stream: the warps' merge must fit one ring slot (m_tiles 2 needs warp_n 32)")
            if not 0 <= self.splits <= STREAM_MAX_CTAS:
                out.append(f"stream: splits (CTAs) must be in 0..{STREAM_MAX_CTAS}, got {self.splits}")
        elif not 0 <= self.splits <= MAX_SPLITS:
            out.append(f"splits must be in 0..{MAX_SPLITS} (0: heuristic), got {self.splits}")
        if not out and not self.regs and self.accum_regs > MAX_ACCUM_REGS:
            out.append(f"{self.accum_regs} fp32 accumulator registers per thread (O and S) "
                       f"exceed the budget of {MAX_ACCUM_REGS}: it would spill")
        if not out and self.lean and self.accum_regs + self.m_tiles * self.head_dim // 4 > MAX_ACCUM_REGS:
            out.append(f"lean: {self.accum_regs} fp32 accumulator registers per thread plus "
                       f"{self.m_tiles * self.head_dim // 4} of Q's fragments exceed the budget of "
                       f"{MAX_ACCUM_REGS}: it would spill (one row tile up to d 128 fits)")
        chunks = self.head_dim // 8
        lanes = 4 if chunks <= 4 else 8 if chunks <= 8 else 16 if chunks <= 16 else 32
        if not out and not self.regs and (32 * self.warps) % lanes:
            out.append(f"{32 * self.warps} threads do not cover whole {self.head_dim}-column rows")
        if self.tma:
            if self.head_dim > TMA_MAX_HEAD_DIM:
                out.append(f"tma: head_dim must be <= {TMA_MAX_HEAD_DIM} (a box row holds the head dim "
                           f"and 8 padding columns, at most 256), got {self.head_dim}")
            if self.block_n > 256:
                out.append(f"tma: warps * warp_n (the block's keys, one TMA box) must be <= 256, "
                           f"got {self.block_n}")
            if (self.fused_combine or self.page_prefetch or self.l2_prefetch or self.warp_loads or self.page_gather
                    or self.lean):
                out.append("tma: the Hopper loop has no fused_combine, no page_prefetch, no "
                           "l2_prefetch, no warp_loads, no page_gather and no lean (options of the cp.async loop)")
            if not out and self.warps >= 8 and self.accum_regs > TMA_MAX_ACCUM_REGS_WIDE:
                out.append(f"tma: {self.accum_regs} fp32 accumulator registers per thread exceed the "
                           f"budget of {TMA_MAX_ACCUM_REGS_WIDE} at {self.warps} warps plus the producer "
                           "(ptxas caps them at 168 registers): it would spill; use 4 warps")
        return out


def tma_box_rows(config, page_size: int) -> int:
    """Keys per TMA box of the tma loop: the K/V block (contiguous caches), or the largest
    divisor of the block that divides the page size (paged: a box never crosses a page when the
    row's cache_leftpad is a multiple of it); 0 without tma."""
    if not getattr(config, "tma", False):
        return 0
    return math.gcd(config.block_n, page_size) if page_size else config.block_n


def tma_map_args(config, problem: Problem, strides, page_size: int, num_pages: int) -> tuple:
    """(dims, strides in bytes, box) of a cache's tensor map, innermost first: (head_dim,
    capacity, nheads_kv, batch_cache) for a contiguous cache, (head_dim, page_size, nheads_kv,
    num_pages) for a paged one, with the cache's (batch / page, row, head) strides in elements;
    box (config.head_dim + 8) x tma_box_rows x 1 x 1: the 8 columns past the head dim lie
    outside the tensor and arrive as zeros, which pads each shared-memory row as the
    ldmatrix addressing expects. A dimension of extent 1 gets a 16-byte stride (any stride is
    legal there and never multiplied by a non-zero coordinate)."""
    rows = page_size or problem.seqlen_k
    dims = (problem.head_dim, rows, problem.nheads_kv, num_pages)
    batch_stride, row_stride, head_stride = strides
    strides_bytes = tuple(2 * st if n > 1 else 16 for st, n in
                          ((row_stride, rows), (head_stride, problem.nheads_kv), (batch_stride, num_pages)))
    return dims, strides_bytes, (config.head_dim + 8, tma_box_rows(config, page_size), 1, 1)


TMA_SWIZZLE_NONE = 0
TMA_L2_PROMOTION_256B = 3
TMA_OOB_FILL_ZEROS = 0
_MAP_CACHE: dict = {}
_MAP_CACHE_MAX = 1024


def tensor_map(dtype: str, ptr: int, map_args: tuple) -> bytes:
    """A cache's encoded tensor map (128 bytes), cached per (dtype, pointer, dims, strides, box);
    encoded by sm90_fwd's cuTensorMapEncodeTiled binding (its ``_encoder``, which tests fake)."""
    from . import sm90_fwd

    key = (dtype, ptr, map_args)
    blob = _MAP_CACHE.get(key)
    if blob is None:
        if len(_MAP_CACHE) >= _MAP_CACHE_MAX:
            _MAP_CACHE.clear()
        dims, strides_bytes, box = map_args
        blob = _MAP_CACHE[key] = sm90_fwd._encoder(
            sm90_fwd.CU_TENSOR_MAP_DATA_TYPE[dtype], ptr, dims, strides_bytes, box, TMA_SWIZZLE_NONE,
            TMA_L2_PROMOTION_256B, TMA_OOB_FILL_ZEROS)
    return blob


def row_blocks(config, problem: Problem) -> int:
    """CTAs over the (nheads / nheads_kv) · seqlen_q packed query rows of one KV head."""
    group = problem.nheads // max(problem.nheads_kv, 1)
    return max(1, -(-group * problem.seqlen_q // config.rows))


def ctas_per_sm(config, max_smem: int) -> int:
    """Resident CTAs of ``config`` per SM: shared memory (each CTA also takes 1 KB the system
    reserves; an SM has the per-block opt-in maximum plus that KB) and threads."""
    by_smem = (max_smem + SMEM_RESERVED) // (config.smem_bytes + SMEM_RESERVED)
    by_regs = REGISTER_FILE // (REGS_THREAD_REGISTERS * config.threads) if getattr(config, "regs", 0) else by_smem
    return max(1, min(by_smem, by_regs, MAX_THREADS_PER_SM // config.threads))


def num_splits_for(config, problem: Problem, sm_count: int, max_smem: Optional[int] = None) -> int:
    """The split count for num_splits=0, from shapes only (never tensor values).

    Time is modelled in K/V blocks of one CTA. With s splits the (batch, KV head, row block)
    groups make groups·s CTAs; the busiest SM runs ceil(groups·s / SMs) of them, c at a time
    (c: resident CTAs per SM, from the config's shared memory and threads, ``ctas_per_sm``).
    One CTA's K/V ring already keeps an SM's share of HBM bandwidth busy, so CTAs resident
    together share it: the SM streams all its CTAs' blocks one after another, ceil(blocks / s)
    each, and pays the fixed cost of a split (``config.split_cost``: its prologue, its
    partial's write, its share of the merge, in K/V blocks) once per round of c CTAs (the
    others stream meanwhile). With s > 1 and no fused combine (``config.fused_combine``) the
    separate decode_combine launch adds COMBINE_LAUNCH_COST. With c = 1 this is ceil(groups·s
    / SMs) waves of (ceil(blocks / s) + split_cost). The s in 1..128 (each split at least
    MIN_SPLIT_BLOCKS blocks) with the least time wins; ties go to fewer splits. Measured on
    the H100 (decode sweep, results/<gpu>/decode_splits.json), a wave that is not whole costs
    like a whole one: at batch 8 x 8 KV heads, 3 splits is 20% slower than 2 or 4.

    The Hopper loop (``tma``) runs the same model: its producer keeps all ``stages`` blocks in
    flight, so an SM's blocks stream back to back as the model assumes, and its fixed cost per
    split (barrier set-up, the Q tile, the first box's latency, the warps' merge, the partial's
    write) is again ``split_cost`` blocks; its threads (warps + the producer) and shared memory
    (plus the mbarriers) enter ``ctas_per_sm``. tests/decode_timing.py times it at half and
    twice this count to refit split_cost per loop.

    Paged caches (``paged_kv``) with more than one resident CTA per SM: a block's cp.asyncs wait
    on its rows' block_table reads, so a CTA streams at the rate its threads' dependent loads
    allow, not at the SM's share of HBM, and CTAs resident together add up (H100, page 16, 4
    warps x 3 stages: 85 us at 1 x 32k with 128 CTAs, one per SM, against 64 for 8 warps; 1504
    us at 32 x 32k with two per SM, against 1663). There each round of c CTAs streams in
    parallel: ceil(per_sm / c) rounds of (ceil(blocks / s) + split_cost), which fills every
    resident slot (PAGED_SPLIT_RULE_RESIDENT; with c = 1 both models agree). Contiguous caches
    take that model under SPLIT_RULE_RESIDENT_CONTIGUOUS (co-resident CTAs overlap each other's
    prologue and epilogue with their streaming). A config with ``regs_cluster`` runs that many splits
    (the cluster's CTAs)."""
    if getattr(config, "regs_cluster", 0):
        return config.regs_cluster
    if getattr(config, "stream", False):   # the SMs' resident CTA slots (decode_splitkv_stream)
        resident = ctas_per_sm(config, default_max_smem((9, 0)) if max_smem is None else max_smem)
        slots = max(2, min(sm_count * resident, STREAM_MAX_CTAS))
        groups = problem.batch * problem.nheads_kv * row_blocks(config, problem)
        if STREAM_WHOLE_GROUPS and 0 < groups <= slots:   # ranges that do not cross groups (if the keys are equal)
            slots = max(2, slots // groups * groups)
        return STREAM_FORCE_CTAS or slots
    groups = problem.batch * problem.nheads_kv * row_blocks(config, problem)
    if groups == 0:
        return 1
    blocks = -(-problem.seqlen_k // config.block_n)
    resident = ctas_per_sm(config, default_max_smem((9, 0)) if max_smem is None else max_smem)
    best, best_time = 1, None
    paged = "paged_kv" in problem.features
    # (a staged regs config, regs_staged: its CTAs' rings stream side by side, as cuDNN's 4-warp CTAs two per SM)
    parallel = resident > 1 and (PAGED_SPLIT_RULE_RESIDENT if paged
                                 else SPLIT_RULE_RESIDENT_CONTIGUOUS or bool(getattr(config, "regs_staged", 0)))
    for s in range(1, max(1, min(blocks // MIN_SPLIT_BLOCKS, MAX_SPLITS)) + 1):
        per_sm = -(-groups * s // sm_count)
        if parallel:   # co-resident CTAs stream side by side (paged: latency-bound table reads)
            time = -(-per_sm // resident) * (-(-blocks // s) + config.split_cost)
        else:          # co-resident CTAs share the SM's bandwidth
            time = per_sm * -(-blocks // s) + -(-per_sm // resident) * config.split_cost
        if s > 1 and not getattr(config, "fused_combine", False):
            time += COMBINE_LAUNCH_COST
        if best_time is None or time < best_time:
            best, best_time = s, time
    return best


# Device rules (tuned tables' ``rules``, cuflash.select): what a rule's ``match`` may test, each
# key's check of the problem (d: the compile-time head dim), and the parameters its ``set`` may
# give the heuristic, each with its range:
#   regs        the regs kernel's load hint (REGS_DEFAULT; 0: the older loops), at head dims 64 and 128
#   regs_warps  its warps (REGS_WARPS)
#   regs_prefetch, regs_prefetch_blocks, regs_ahead, regs_ahead_l1, regs_order: its options (the config
#               fields; 0 / 1 for the flags), over regs_options' (REGS_BATCH1_RULES); contiguous caches
#               but regs_order
#   pdl         programmatic dependent launch of the regs kernel's calls (PDL_RULES), contiguous and paged
#   split_cost  the split rule's fixed cost per split, in K/V blocks (num_splits_for)
#   splits      a fixed split count (0: the split rule's)
def _span(value, x) -> bool:
    """[lo, hi] (inclusive; hi null: no bound) holds x."""
    lo, hi = value
    return (lo is None or x >= lo) and (hi is None or x <= hi)


RULE_MATCH = {
    "batch": lambda v, p, d: _span(v, p.batch),
    "seqlen_k": lambda v, p, d: _span(v, p.seqlen_k),
    "seqlen_q": lambda v, p, d: _span(v, p.seqlen_q),
    "group": lambda v, p, d: _span(v, p.nheads // max(p.nheads_kv, 1)),
    "nheads_kv": lambda v, p, d: _span(v, p.nheads_kv),
    "head_dim": lambda v, p, d: d in v,
    "dtype": lambda v, p, d: p.dtype in v,
    "paged": lambda v, p, d: bool(v) == ("paged_kv" in p.features),
    "causal": lambda v, p, d: bool(v) == bool(p.causal),
}
RULE_REGS_OPTIONS = ("regs_prefetch", "regs_prefetch_blocks", "regs_ahead", "regs_ahead_l1", "regs_order",
                     "regs_page_table")
# The regs options a device rule may set for paged caches: the block order, and the page table with its early
# prefetch (REGS_SHAPE_RULES' paged fields; the H200's table turns them off: tuning/configs/NVIDIA_H200_sm90.yaml).
RULE_PAGED_OPTIONS = ("regs_order", "regs_page_table", "regs_prefetch", "regs_prefetch_blocks")
RULE_SET = {
    "regs": lambda v: v in REGS_VALUES,
    "regs_warps": lambda v: v in (2, 4, 8, 16),
    "regs_prefetch": lambda v: v in (0, 1),
    "regs_prefetch_blocks": lambda v: v in (1, 2, 3),
    "regs_ahead": lambda v: v in REGS_AHEAD_VALUES,
    "regs_ahead_l1": lambda v: v in (0, 1),
    "regs_order": lambda v: v in REGS_ORDER_VALUES,
    "regs_page_table": lambda v: v in (0, 1, 2),
    "pdl": lambda v: v in PDL_VALUES,
    "split_cost": lambda v: v >= 0,
    "splits": lambda v: 0 <= v <= MAX_SPLITS,
}


def rule_matches(match: dict, problem: Problem, d: int) -> bool:
    """Whether a device rule's ``match`` holds for ``problem`` (compile-time head dim ``d``); an
    unknown key or a malformed value raises ValueError."""
    for key, value in match.items():
        test = RULE_MATCH.get(key)
        if test is None:
            raise ValueError(f"rule match: unknown key {key!r} (known: {', '.join(RULE_MATCH)})")
        try:
            if not test(value, problem, d):
                return False
        except (TypeError, ValueError) as exc:
            raise ValueError(f"rule match: {key}={value!r}: {exc}") from None
    return True


def stream_problem(config, problem: Problem) -> str:
    """'' when ``config``'s stream kernel (``stream``) can run ``problem``, else why not (naming the
    argument); '' for a config without it."""
    if not getattr(config, "stream", False):
        return ""
    if "window" in problem.features or (problem.causal and problem.seqlen_q > 1):
        return ("window_size: the stream kernel (config stream) runs calls without a window, and causal "
                "ones at seqlen_q 1 only")
    if problem.batch > STREAM_MAX_BATCH:
        return f"q: the stream kernel (config stream) runs at most {STREAM_MAX_BATCH} batch rows, got {problem.batch}"
    return ""


def _splits(config, problem: Problem, sm_count: int = 132) -> int:
    return config.splits or num_splits_for(config, problem, sm_count)


class DecodeSplitKV(Family):
    name = "decode_splitkv"
    op = "decode"
    version = 2
    config_cls = DecodeConfig
    space = {"warps": (2, 4, 8), "warp_n": (16, 32), "stages": (2, 3, 4, 6), "m_tiles": (1, 2),
             "split_cost": (2, 4, 8), "fused_combine": (False, True), "page_prefetch": (False, True),
             "tma": TMA_SPACE, "l2_prefetch": L2_PREFETCH_SPACE, "warp_loads": WARP_LOADS_SPACE,
             "page_gather": PAGE_GATHER_SPACE, "lean": LEAN_SPACE, "bulk": BULK_SPACE,
             "early_merge": EARLY_MERGE_SPACE, "ring_fill": RING_FILL_SPACE, "dynamic": DYNAMIC_SPACE,
             "stream": STREAM_SPACE, "light_fence": LIGHT_FENCE_SPACE,
             "regs": REGS_SPACE,
             "regs_prefetch": (False,), "regs_ahead": (0,), "regs_ahead_l1": (False,),
             "regs_order": (0,), "regs_prefetch_blocks": (1,), "regs_cluster": (0,), "regs_page_table": (0,),
             "pdl": (0,), "regs_staged": (0,)}   # pdl: a property of the call's neighbours, not of one call timed alone (PDL_RULES)
    fixed = {"splits": 0}
    # DecodeParams plus the Hopper loop's tensor maps: packed for every launch; the kernels but
    # decode_splitkv_tma take DecodeParams, its prefix
    params_struct = "DecodeTmaParams"
    kernel_param_decl = "const cuflash::DecodeParams"
    # the Hopper loop takes its params as a grid constant (TMA reads the maps in parameter space)
    kernel_param_decls_by_kernel = {"cuflash::decode_splitkv_tma":
                                    "const __grid_constant__ cuflash::DecodeTmaParams"}
    pointer_fields = ("q", "k_cache", "v_cache", "k_new", "v_new", "rotary_cos", "rotary_sin",
                      "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table",
                      "alibi_slopes", "o", "lse", "o_partial", "lse_partial", "q_rot")
    min_arch = (8, 0)
    # the Problem.features it runs (all of flash_attn_with_kvcache's; masks, softcap and ALiBi
    # are run-time parameters of one kernel)
    features = ("alibi", "append", "cache_batch_idx", "leftpad", "paged_kv", "rotary", "softcap",
                "window")
    description = ("split-KV decode (flash-decoding): GQA-packed query rows, cp.async K/V ring, "
                   "mma.sync, LSE combine; paged KV, append + rotary")

    def supports(self, arch, problem: Problem) -> str:
        why = super().supports(arch, problem)
        if why:
            return why
        if problem.head_dim % 8 or not 0 < problem.head_dim <= MAX_HEAD_DIM:
            return f"q: headdim must be a multiple of 8 in 8..{MAX_HEAD_DIM}, got {problem.head_dim}"
        if problem.nheads_kv < 1 or problem.nheads % problem.nheads_kv:
            return "k_cache: nheads_kv must divide nheads"
        other = [f for f in problem.features if f not in self.features]
        return f"{self.name} has no feature {other[0]!r}" if other else ""

    def heuristic_for_device(self, problem: Problem, arch, max_smem: Optional[int], rule) -> Optional[DecodeConfig]:
        """The heuristic's config for ``problem`` under one device rule of a tuned table
        (``cuflash.select.Rule``: ``match``, ``set``; see RULE_MATCH and RULE_SET), or None when
        the rule does not match. Raises ValueError (the rule is then ignored with a warning) for
        an unknown key, a bad value or parameters that give no valid config."""
        if not rule_matches(rule.match, problem, self.head_dim_of(problem.head_dim)):
            return None
        knobs = dict(rule.set)
        for key, value in knobs.items():
            if key not in RULE_SET:
                raise ValueError(f"rule set: unknown parameter {key!r} (known: {', '.join(RULE_SET)})")
            if not isinstance(value, int) or isinstance(value, bool) or not RULE_SET[key](value):
                raise ValueError(f"rule set: {key}={value!r} is out of range")
        cfg = self.heuristic(problem, arch, max_smem, knobs)
        cfg = cfg.replace(**{k: knobs[k] for k in ("split_cost", "splits") if k in knobs})
        why = cfg.problems(default_max_smem(arch) if max_smem is None else max_smem)
        if why:
            raise ValueError(f"rule set {knobs} gives {cfg.name}: {'; '.join(why)}")
        return cfg

    def heuristic(self, problem: Problem, arch=(9, 0), max_smem: Optional[int] = None,
                  knobs: Optional[dict] = None) -> DecodeConfig:
        """Bandwidth first: 8 warps of 16 keys (128-key K/V blocks, one 16-key mma tile per warp,
        so the O accumulator is all a thread keeps) and a 3-stage ring at d <= 128 (217 KB at
        d 128: 209 KB of K/V in flight on each H100 SM); 2 stages above; fewer warps and stages
        where shared memory is small. On the H100 (bf16, d 128, 32:8 heads) this set, with its
        best split count, was the fastest or within 2% of it in every batch x context cell of
        the decode sweep (results/<gpu>/decode_splits.json), against 4 warps with 3 or 4 stages,
        2 warps, and 32-key warps. Two row tiles when the packed rows (group · seqlen_q) exceed
        16 at head dims 64..128: above, the two O accumulators crowd the register file; at d 48
        ptxas (nvcc 13.0, sm_90a) spills 4 bytes (d 16 and 32 would not, but decode models do
        not use them). split_cost 4: the split rule's fixed cost per split, fitted to the same
        sweep."""
        d = self.head_dim_of(problem.head_dim)
        max_smem = default_max_smem(arch) if max_smem is None else max_smem
        group = problem.nheads // max(problem.nheads_kv, 1)
        m_tiles = 2 if group * problem.seqlen_q > 16 and 64 <= d <= 128 else 1
        stages = 3 if d <= 128 else 2
        warps = 8
        if d <= 128 and "paged_kv" not in problem.features:  # contiguous caches: see CONTIGUOUS_WARPS
            warps, stages = CONTIGUOUS_WARPS, CONTIGUOUS_STAGES
            groups = problem.batch * problem.nheads_kv * -(-group * problem.seqlen_q // (16 * m_tiles))
            if CONTIGUOUS_SMALL_TILE_MIN_GROUPS and groups >= CONTIGUOUS_SMALL_TILE_MIN_GROUPS:
                warps, stages = 4, 3
        cfg = DecodeConfig(warps, 16, stages, m_tiles, 4, d, problem.dtype, bool(problem.causal),
                           fused_combine=FUSED_COMBINE_DEFAULT,
                           page_prefetch=PAGE_PREFETCH_DEFAULT and "paged_kv" in problem.features,
                           l2_prefetch=0 if "paged_kv" in problem.features else L2_PREFETCH_DEFAULT,
                           warp_loads=WARP_LOADS_DEFAULT,
                           page_gather=PAGE_GATHER_DEFAULT and "paged_kv" in problem.features)
        bulk = BULK_PAGED_DEFAULT if "paged_kv" in problem.features else BULK_DEFAULT
        if bulk and tuple(arch)[0] == 9 and not (cfg.warp_loads or cfg.page_prefetch or cfg.page_gather):
            cfg = cfg.replace(bulk=bulk, l2_prefetch=0)   # sm_90 only; whole blocks take no cp.async hint
        if EARLY_MERGE_DEFAULT and cfg.fused_combine:
            cfg = cfg.replace(early_merge=True)
        if LIGHT_FENCE_DEFAULT and cfg.fused_combine and "paged_kv" not in problem.features:
            cfg = cfg.replace(light_fence=True)
        if RING_FILL_DEFAULT:
            cfg = cfg.replace(ring_fill=RING_FILL_DEFAULT)
        groups = problem.batch * problem.nheads_kv * row_blocks(cfg, problem)
        if (DYNAMIC_DEFAULT and "paged_kv" not in problem.features and groups <= DYNAMIC_MAX_GROUPS
                and problem.seqlen_k >= DYNAMIC_MIN_KEYS and (cfg.fused_combine or DYNAMIC_DEFAULT == 2)
                and not (cfg.bulk or cfg.page_prefetch or cfg.warp_loads)):
            cfg = cfg.replace(dynamic=DYNAMIC_DEFAULT, ring_fill=max(cfg.ring_fill, 1))   # see DYNAMIC_DEFAULT
        if (STREAM_DEFAULT and ("paged_kv" not in problem.features or STREAM_PAGED) and cfg.fused_combine
                and not cfg.bulk and d <= 128 and m_tiles == 1
                and not stream_problem(cfg.replace(stream=True, ring_fill=0, dynamic=0), problem)):
            cfg = cfg.replace(stream=True, ring_fill=0, dynamic=0, lean=False, light_fence=False, warps=CONTIGUOUS_WARPS,
                              stages=CONTIGUOUS_STAGES)   # see STREAM_DEFAULT
            if cfg.problems(max_smem):
                cfg = cfg.replace(stream=False)
        knobs = knobs or {}   # a device rule's parameters (heuristic_for_device; RULE_SET)
        regs_hint = knobs.get("regs", REGS_DEFAULT)   # a rule's regs: any head dim the kernel runs
        if (regs_hint and tuple(arch)[0] == 9 and d == problem.head_dim
                and d in (REGS_HEAD_DIMS if "regs" in knobs else REGS_HEAD_DIM_DEFAULT)
                and not cfg.stream and (group * problem.seqlen_q <= 8 or d <= 64)):
            regs = cfg.replace(regs=regs_hint, warps=knobs.get("regs_warps", REGS_WARPS), warp_n=16,
                               m_tiles=1 if group * problem.seqlen_q <= 8 else 2,
                               page_prefetch=False, l2_prefetch=0, warp_loads=False, page_gather=False, lean=False,
                               bulk=0, early_merge=False, ring_fill=0, dynamic=0,
                               light_fence=LIGHT_FENCE_DEFAULT and cfg.fused_combine,
                               regs_prefetch=REGS_PREFETCH_DEFAULT and "paged_kv" not in problem.features)
            regs = regs_options(regs, problem, hint="regs" not in knobs)
            options = {k: bool(v) if k in ("regs_prefetch", "regs_ahead_l1") else v for k, v in knobs.items()
                       if k in RULE_REGS_OPTIONS and ("paged_kv" not in problem.features or k in RULE_PAGED_OPTIONS)}
            if options:   # a device rule's regs options, over the batch-1 and shape rules'
                regs = regs.replace(**options)
            pdl = knobs.get("pdl", pdl_for(problem))   # see PDL_RULES
            if pdl and not regs.regs_cluster:
                regs = regs.replace(pdl=pdl)
            if not regs.problems(max_smem):
                return regs   # see REGS_DEFAULT
        if TMA_DEFAULT and tuple(arch)[0] == 9 and d == problem.head_dim and d <= TMA_MAX_HEAD_DIM:
            # the Hopper loop: the same tiles where they fit, else 4 warps (64-key blocks) with
            # a ring as deep in bytes
            tma = cfg.replace(fused_combine=False, page_prefetch=False, l2_prefetch=0, warp_loads=False, page_gather=False,
                              lean=False, bulk=0, early_merge=False, ring_fill=0, dynamic=0, tma=True,
                              split_cost=TMA_SPLIT_COST, stream=False, light_fence=False)
            for shrink in ({}, {"warps": 4, "stages": 2 * stages}, {"warps": 4, "stages": stages},
                           {"warps": 4, "stages": 2}):
                candidate = tma.replace(**shrink)
                if not candidate.problems(max_smem):
                    return candidate
        for shrink in ({}, {"stages": 2}, {"warps": 4, "stages": 2}, {"warps": 2, "stages": 2},
                       {"warps": 2, "stages": 2, "m_tiles": 1}):
            candidate = cfg.replace(**shrink)
            if not candidate.problems(max_smem):
                if LEAN_DEFAULT and not candidate.replace(lean=True).problems(max_smem):
                    candidate = candidate.replace(lean=True)   # where Q's fragments fit (LEAN_DEFAULT)
                return candidate
        return cfg.validate(max_smem)

    def make(self, point, problem: Problem):
        """As Family.make; a point without ``tma``, ``l2_prefetch``, ``warp_loads`` or ``page_gather``
        (tuned tables and recorded studies from before them) gets False / 0 / False / False: the
        cp.async loop as it was."""
        point = {"tma": False, "l2_prefetch": 0, "warp_loads": False, "page_gather": False, "lean": False,
                 "bulk": 0, "early_merge": False, "ring_fill": 0, "dynamic": 0, "stream": False, "light_fence": False,
                 "regs": 0, "regs_prefetch": False, "regs_ahead": 0, "regs_ahead_l1": False,
                 "regs_order": 0, "regs_prefetch_blocks": 1, "regs_cluster": 0, "regs_page_table": 0, "pdl": 0, "regs_staged": 0,
                 **point}
        return super().make(point, problem)

    def tma_problem(self, config, problem: Problem, arch=(9, 0), page_size: int = 0) -> str:
        """'' when ``config``'s Hopper loop (``tma``) can run ``problem`` (a call with caches of
        ``page_size`` keys per page, 0: contiguous) on ``arch``, else why not (naming the
        argument). A config without tma runs everywhere the family does, but bulk needs sm_90."""
        if getattr(config, "bulk", 0) and tuple(arch)[0] != 9:
            return f"config: {config.name} (bulk) needs sm_90 (cp.async.bulk), got sm_{arch[0]}{arch[1]}"
        if getattr(config, "pdl", 0) and tuple(arch)[0] != 9:
            return f"config: {config.name} (pdl) needs sm_90 (griddepcontrol), got sm_{arch[0]}{arch[1]}"
        if not getattr(config, "tma", False):
            return ""
        if tuple(arch)[0] != 9:
            return f"config: {config.name} (tma) needs sm_90 (TMA), got sm_{arch[0]}{arch[1]}"
        if problem.head_dim != config.head_dim:
            return (f"q: the tma loop needs the head dim to equal the config's {config.head_dim} "
                    f"(its TMA boxes carry no column mask), got {problem.head_dim}")
        if page_size % TMA_PAGE_MULTIPLE:
            return (f"k_cache: the tma loop needs a page_block_size that is a multiple of "
                    f"{TMA_PAGE_MULTIPLE}, got {page_size}")
        if not page_size and problem.seqlen_k == 0:
            return ("k_cache: the tma loop needs a cache of at least one row (a tensor map has no "
                    "zero-extent dimension), got seqlen_cache=0")
        return ""

    def call_config(self, config, problem: Problem, arch, page_size: int, chosen: bool,
                    heuristic: bool = False, max_smem: Optional[int] = None):
        """The config a call runs, from ``config`` (given, tuned or the heuristic's for the problem
        class) and what only the call knows, its cache's page size (0: contiguous): a given config
        with tma that cannot run the call raises (ValueError naming the argument); a chosen one
        (``chosen``: the heuristic's or a tuned table's) falls back to the cp.async loop there,
        and the heuristic's choice (``heuristic``) without the cp.async loop's options takes, for
        small pages (TMA_PAGED_MAX_PAGE), the Hopper loop on sm_90 (TMA_PAGED_DEFAULT) or else
        the cp.async loop with SMALL_PAGE_WARPS warps (4: 3 stages, two CTAs per SM)."""
        why = stream_problem(config, problem)
        if why:
            if not chosen:
                raise ValueError(why)
            config = config.replace(stream=False)
        why = self.tma_problem(config, problem, arch, page_size)
        if why:
            if not chosen:
                raise ValueError(why)
            config = config.replace(tma=False, bulk=0, pdl=0)
        if getattr(config, "regs", 0) and problem.head_dim != config.head_dim:
            if not chosen:
                raise ValueError(f"q: the regs kernel (config regs) needs the head dim to equal the config's "
                                 f"{config.head_dim}, got {problem.head_dim}")
            # early_merge stays only with the fused combine (the cp.async loop's separate combine has no early form)
            config = config.replace(regs=0, regs_prefetch=False, regs_ahead=0, regs_ahead_l1=False, regs_order=0,
                                    regs_prefetch_blocks=1, regs_page_table=0, pdl=0, regs_staged=0, regs_spec=0,
                                    regs_page_shift=0,
                                    early_merge=config.early_merge and config.fused_combine)
            if getattr(config, "regs_cluster", 0):
                config = self.without_cluster(config)
        if getattr(config, "regs_page_table", 0) == 2 and page_size and problem.seqlen_k // page_size > REGS_PAGE_IDS:
            if not chosen:
                raise ValueError(f"block_table: the config's regs_page_table 2 stages the whole table row, at most "
                                 f"{REGS_PAGE_IDS} pages, got {problem.seqlen_k // page_size}")
            config = config.replace(regs_page_table=1)
        if getattr(config, "regs_page_shift", 0) and page_size & (page_size - 1):
            if not chosen:
                raise ValueError(f"k_cache: the config's regs_page_shift needs a page_block_size (k_cache.shape[1]) "
                                 f"that is a power of two, got {page_size}")
            config = config.replace(regs_page_shift=0)
        if (chosen and heuristic and REGS_PAGE_SHIFT_DEFAULT and getattr(config, "regs", 0) and page_size > 0
                and not page_size & (page_size - 1)):
            config = config.replace(regs_page_shift=REGS_PAGE_SHIFT_DEFAULT)
        keys = problem.batch * problem.seqlen_k
        small_call = keys <= SMALL_PAGE_TMA_MAX_KEYS
        large_page_tma = page_size >= TMA_PAGED_MAX_PAGE and keys <= LARGE_PAGE_TMA_MAX_KEYS
        regs_tma = 0 < page_size < TMA_PAGED_MAX_PAGE and keys <= REGS_PAGED_TMA_MAX_KEYS   # see REGS_PAGED_TMA_MAX_KEYS
        if regs_tma and batch1_hint(problem):   # the batch-1 hint's calls stay on the regs kernel (see REGS_BATCH1_HINT)
            regs_tma = False
        if (chosen and heuristic and getattr(config, "regs_page_table", 0) == 1 and not config.regs_prefetch
                and page_size >= TMA_PAGED_MAX_PAGE and not REGS_PAGE_TABLE_DEFAULT):
            config = config.replace(regs_page_table=0)   # the table alone: small pages only (REGS_SHAPE_RULES)
        if (chosen and heuristic and not config.tma and not config.page_prefetch and not config.stream
                and (regs_tma if config.regs else
                     (TMA_PAGED_DEFAULT or small_call) and 0 < page_size < TMA_PAGED_MAX_PAGE or large_page_tma)):
            max_smem = default_max_smem(arch) if max_smem is None else max_smem
            stages = 3 if config.head_dim <= 128 else 2
            tma = config.replace(tma=True, warps=4, stages=stages, split_cost=TMA_SPLIT_COST, l2_prefetch=0,
                                 warp_loads=False, page_gather=False, fused_combine=False, lean=False, bulk=0,
                                 early_merge=False, ring_fill=0, dynamic=0, light_fence=False, regs=0,
                                 regs_prefetch=False, regs_ahead=0, regs_ahead_l1=False, regs_order=0,
                                 regs_prefetch_blocks=1, regs_cluster=0, regs_page_table=0, pdl=0, regs_spec=0,
                                 regs_page_shift=0,
                                 m_tiles=1 if config.regs else config.m_tiles)
            for candidate in (tma, tma.replace(stages=2)):
                if not candidate.problems(max_smem) and not self.tma_problem(candidate, problem, arch, page_size):
                    return candidate
        if (chosen and heuristic and SMALL_PAGE_WARPS != 8 and SMALL_PAGE_WARPS != config.warps
                and 0 < page_size < TMA_PAGED_MAX_PAGE and not config.tma and not config.stream
                and not config.regs):  # 8: off
            max_smem = default_max_smem(arch) if max_smem is None else max_smem
            small = config.replace(warps=SMALL_PAGE_WARPS, stages=3 if config.head_dim <= 128 else 2)
            if not small.problems(max_smem):
                return small
        return config

    def kernel_names(self, config) -> dict:
        d, dt = config.head_dim, config.dtype
        pdl = ", true" if getattr(config, "pdl", 0) else ""   # kPdl: they wait for the previous kernel
        # the regs kernel's early_merge: decode_combine's kEarly (after kPdl)
        early = (", true" if pdl else ", false") + ", true" if config.regs and config.early_merge else ""
        return {"main": config.kernel_name(),
                "append": f"cuflash::decode_append<{d}, cuflash::{dt}{pdl}>",
                "combine": f"cuflash::decode_combine<{d}, cuflash::{dt}{early or pdl}>"}

    def smem_roles(self, config) -> dict:
        return {"main": config.smem_bytes}

    def without_cluster(self, config):
        """``config`` without regs_cluster, merged as the heuristic merges (the fused combine where
        FUSED_COMBINE_DEFAULT): for a call whose split count is not the cluster's (num_splits given,
        or no query rows)."""
        return config.replace(regs_cluster=0, fused_combine=FUSED_COMBINE_DEFAULT,
                              light_fence=LIGHT_FENCE_DEFAULT and FUSED_COMBINE_DEFAULT)

    def pair_cluster(self, config, problem: Problem, splits: int):
        """A chosen ``config`` for a call of ``problem`` at ``splits`` splits: with REGS_CLUSTER_PAIRS
        (REGS_CLUSTER_PAIRS_PAGED for paged caches), a regs config with the fused combine at batch >= 2 and
        exactly 2 splits merges them as one cluster of 2 CTAs (regs_cluster 2) instead; else ``config`` (a staged
        config, regs_staged, keeps its own merge: the staged ring and a cluster are not built together)."""
        paged = "paged_kv" in problem.features
        if (splits == 2 and problem.batch >= 2 and (REGS_CLUSTER_PAIRS_PAGED if paged else REGS_CLUSTER_PAIRS)
                and getattr(config, "regs", 0) and not config.regs_cluster and config.fused_combine
                and not config.pdl and not config.regs_staged and config.head_dim % 8 == 0):
            return config.replace(regs_cluster=2, fused_combine=False, light_fence=False)
        return config

    def kernel_attributes(self, config) -> dict:
        """{role: {CUfunction_attribute: value}} set on the loaded kernels (cuflash.compile.get_kernels):
        clusters of more than 8 CTAs (regs_cluster 16) are a non-portable size, allowed per kernel."""
        if getattr(config, "regs_cluster", 0) > 8:
            return {"main": {CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: 1}}
        return {}

    def launches(self, config, problem: Problem, sm_count: int) -> list:
        p = problem
        splits = _splits(config, p, sm_count)
        pdl = bool(getattr(config, "pdl", 0))   # every launch programmatic (their kernels' kPdl waits)
        out = []
        if "append" in p.features:  # first: the main kernel reads what it writes
            out.append(LaunchSpec("append", (APPEND_CTAS, p.batch), APPEND_THREADS, 0, pdl=pdl))
        grid = (splits, 1, 1) if getattr(config, "stream", False) else (splits, p.nheads_kv * row_blocks(config, p), p.batch)
        out.append(LaunchSpec("main", grid, config.threads, config.smem_bytes, getattr(config, "regs_cluster", 0),
                              pdl=pdl))
        if splits > 1 and not config.fused_combine and not getattr(config, "regs_cluster", 0):
            rows = p.batch * p.nheads * p.seqlen_q
            out.append(LaunchSpec("combine", (-(-rows // COMBINE_ROWS),), 32 * COMBINE_ROWS, 0, pdl=pdl))
        return out

    def split_count(self, config, problem: Problem, sm_count: int,
                    max_smem: Optional[int] = None) -> int:
        """The splits num_splits=0 launches (shapes only; see num_splits_for)."""
        return num_splits_for(config, problem, sm_count, max_smem)

    def counters(self, config, problem: Problem) -> int:
        """int32 counters the config needs kept between calls, zeroed once when allocated (the
        fused combine's per-(batch, KV head, row block) count of finished splits, which its last
        CTA resets to 0; ``dynamic``: as many again, the groups' block-claim counters, which that
        CTA also resets): 0 when none. Not per-call workspace: the plan keeps them
        (``zeroed_counters``), one buffer per CUDA stream (cuflash.launch.StreamCounters), so
        calls of one call shape on two streams may overlap."""
        if not config.fused_combine or _splits(config, problem) <= 1:
            return 0
        groups = problem.batch * problem.nheads_kv * row_blocks(config, problem)
        return 2 * groups if getattr(config, "dynamic", 0) == 1 else groups   # dynamic 1: + the claim counters

    def zeroed_counters(self, config, problem: Problem) -> dict:
        """{params field: int32 count} of the counters a plan keeps between calls, per stream
        (cuflash.launch.Plan writes the launch's stream's buffer into ``split_counters``)."""
        n = self.counters(config, problem)
        return {"split_counters": n} if n else {}

    def workspace(self, config, problem: Problem, strides: Optional[dict] = None) -> dict:
        p = problem
        splits = _splits(config, p)
        out, end = {}, 0
        rows = p.batch * p.nheads * p.seqlen_q
        if getattr(config, "stream", False):   # 2 pieces of kRows rows per CTA, for any SM count
            splits, rows = STREAM_MAX_CTAS, 2 * config.rows
        if splits > 1 and not getattr(config, "regs_cluster", 0):   # (a cluster merges in shared memory)
            out["o_partial"] = end
            end = -(-(end + splits * rows * config.head_dim * 4) // ALIGN) * ALIGN
            out["lse_partial"] = end
            end = -(-(end + splits * rows * 4) // ALIGN) * ALIGN
        if "rotary" in p.features:
            out["q_rot"] = end
            end = -(-(end + rows * p.head_dim * 2) // ALIGN) * ALIGN
        out["total"] = end
        return out

    def static_params(self, config, problem, strides, workspace, softmax_scale, sm_count) -> dict:
        p = problem
        call = dict(strides.get("call", {}))
        out = {}
        for prefix, key in (("q", "q"), ("k", "k_cache"), ("v", "v_cache"), ("kn", "k_new"),
                            ("vn", "v_new"), ("o", "o")):
            fallback = {"k_cache": "k", "v_cache": "v"}.get(key, key)
            st = strides.get(key, strides.get(fallback, (0, 0, 0)))
            out.update({f"{prefix}_batch_stride": st[0], f"{prefix}_row_stride": st[1],
                        f"{prefix}_head_stride": st[2]})
        window = call.get("window", (-1, 0) if p.causal else (-1, -1))
        out.update(
            rotary_row_stride=call.get("rotary_row_stride", 0),
            block_table_stride=call.get("block_table_stride", 0),
            alibi_batch_stride=call.get("alibi_batch_stride", 0),
            batch=p.batch, nheads=p.nheads, nheads_kv=p.nheads_kv, seqlen_q=p.seqlen_q,
            head_dim=p.head_dim, head_dim_rounded=config.head_dim,
            seqlen_new=call.get("seqlen_new", 0), capacity=p.seqlen_k,
            page_size=call.get("page_size", 0), num_pages=call.get("num_pages", p.batch),
            cache_seqlen_fixed=call.get("cache_seqlen_fixed", p.seqlen_k),
            rotary_dim=call.get("rotary_dim", 0),
            rotary_interleaved=int(call.get("rotary_interleaved", True)),
            rotary_q_per_row=int(call.get("rotary_q_per_row", False)),
            window_left=window[0], window_right=window[1],
            num_splits=_splits(config, p, sm_count), group=p.nheads // max(p.nheads_kv, 1),
            row_blocks=row_blocks(config, p), softmax_scale=softmax_scale,
            scale_log2=softmax_scale * LOG2E, softcap=call.get("softcap", 0.0),
            split_counters=call.get("split_counters", 0),
            tma_box_rows=tma_box_rows(config, call.get("page_size", 0)), tma_k=0, tma_v=0)
        # split_counters: the plan writes its launch stream's counters there (zeroed_counters)
        return out

    def call_writer(self, config, problem: Problem, strides: dict, struct):
        """The tma loop's per-call step (cuflash.launch.Plan runs it after writing the pointers):
        the tensor maps of k_cache and v_cache (ptrs[1], ptrs[2]) into the packed params, at the
        tma_k / tma_v offsets of ``struct``. None (no per-call step) without tma.

        A map embeds its cache's address: maps are encoded once per (k_cache, v_cache) address
        pair of the plan (the plan fixes shapes, strides and boxes) and kept, so a serving loop
        that reuses its cache costs one dict lookup and one 256-byte copy per call. A CUDA graph
        captures the params by value, maps included: replays read the cache tensors of the
        capture, as they do for every pointer argument (reuse the same cache tensors across
        replays; their contents and cache_seqlens may change)."""
        if not getattr(config, "tma", False):
            return None
        call = strides.get("call", {})
        page = call.get("page_size", 0)
        args = {name: tma_map_args(config, problem, strides.get(name, strides.get(name[0], (0, 0, 0))), page,
                                   call.get("num_pages", problem.batch))
                for name in ("k_cache", "v_cache")}
        k_off, v_off = struct.fields["tma_k"][1], struct.fields["tma_v"][1]
        if v_off != k_off + 128:
            raise RuntimeError(f"{self.params_struct}: tma_k and tma_v must be adjacent")
        dtype = problem.dtype
        blobs: dict = {}
        written = [None]  # the address pair whose maps the packed params hold now

        def write(buf, ptrs):
            key = (ptrs[1], ptrs[2])
            if key == written[0]:  # a serving loop's cache: the maps are in place already
                return
            blob = blobs.get(key)
            if blob is None:
                if len(blobs) >= 64:
                    blobs.clear()
                blob = blobs[key] = np.frombuffer(
                    tensor_map(dtype, ptrs[1], args["k_cache"]) + tensor_map(dtype, ptrs[2], args["v_cache"]),
                    np.uint8)
            buf[k_off:k_off + 256] = blob
            written[0] = key

        return write

    def bench_problem(self, dtype: str, head_dim: int, causal: bool, seqlen: int,
                      features: tuple = ()) -> Problem:
        """The tuner's shape for a seqlen bucket: one query row, 32 query heads on 8 KV heads
        (the issue's serving shape), 128k cached keys in all (batch 131072 / seqlen): the
        split rule matters most at small batch, the tiles at large."""
        return Problem("decode", dtype, max(1, 131072 // seqlen), 1, seqlen, 32, 8, head_dim,
                       causal, False, tuple(features))

    def flops(self, problem: Problem) -> float:
        p = problem
        return 4.0 * p.batch * p.nheads * p.seqlen_q * p.seqlen_k * p.head_dim


FAMILY = register(DecodeSplitKV())
