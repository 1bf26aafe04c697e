"""sm90_bwd: the FlashAttention backward for Hopper (kernels_cu/sm90_bwd.cu), sm_90a only.

FA3's structure: one CTA per K/V block; a producer warpgroup loads K_j, V_j once and, per Q
block, Q_i and dO_i by TMA plus the block's LSE·log2e and D rows by cp.async into an
mbarrier ring; 1 or 2 consumer warpgroups of 64 keys each compute, all by wgmma,
Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (SS), dV += Pᵀ dO and dK += dSᵀ Q (RS, Pᵀ and dSᵀ straight from
registers), and the dQ part dS K (SS, dS stored to shared memory), which they add to an fp32
accumulator in global memory with red.global.add (in K/V block order when deterministic).

The preprocess (D = rowsum(dO∘O), LSE·log2e, zeroed accumulators; it also reads dout through
any strides and copies it when TMA cannot read it in place), the dQ convert and the GQA/MQA
dK/dV reduction are fa2_bwd's kernels: sm90_bwd.cu includes fa2_bwd.cu, and Sm90BwdParams
starts with BwdParams field for field (the workspace layout is fa2_bwd's too).

Selection: ranked above fa2_bwd at every head dim up to 128, as measured on the H100
(``rank``; D64_ABOVE_FA2 / D96_ABOVE_FA2 switch head dims <= 96 back); head dims 193..256 too
(D256_ABOVE_FA2, measured: 2.1-2.3x fa2_bwd), 129..192 too (D192_ABOVE_FA2, measured: 1.5-1.65x);
``config=`` / ``bwd_config=`` force either. Head dims up to 256 (kernels for 64, 128 and 256).
Features: sliding window (Q blocks outside a K/V block's band are skipped), softcap and ALiBi,
as compile-time flags (config fields window / softcap / alibi, names _win / _cap / _alibi, as
fa2_bwd's), and dropout (field dropout, name _drop; the Philox keep mask of philox.cuh, keyed by
element coordinates like every forward's); varlen (field varlen, kVarlen, set from the call:
K/V blocks of each sequence, fa2_bwd's token-indexed workspace) while VARLEN_BWD is on (the
default), not deterministic above d64 (spills); not the dropout mixes that spill
(dropout_mix): supports() refuses them and selection falls back to fa2_bwd. dQ by bulk
reduce-add through shared memory (FA3's way) is the opt-in field dq_bulk (name _dqb; in the
tuning space). FA3's backward schedule, opt-in fields in the tuning space too, default off until
measured (tests/sm90_bwd_sched_timing.py): overlap_sdp (name _ovl: dPᵀ issued behind Sᵀ, Pᵀ
computed while it runs) and dq_writer (name _dqw: dQ_i staged in swizzled shared memory, added
by a producer warp's tensor bulk reduce-adds). The heuristic keeps red.add: on the H100 (session 11,
logs/session11_final/timing.log) one bulk add per 256-byte row issued by the consumer warps
took 1.05-1.06x red.add's time at d128 and 1.18x at d64, bf16, 8k-16k.
Head dim 64 has three tiles: BM64 BN64 with one consumer; BM64 BN128 with two, each computing
32 of dQ_i's 64 columns (wgmma m64n32k16); and FA3's BM128 BN128 with two, each 64 rows of dQ_i
(PTXAS_FITS: not with softcap, ALiBi, dropout). D64_ABOVE_FA2 / D64_SHAPE / D96_ABOVE_FA2
hold the choice at head dims <= 96 (one line each; measured: the family first, BM128 BN128 c2).
Head dim 256 has one tile: BM64 BN64 with two consumers sharing the K/V block's keys
(Sm90BwdConfig.shared_keys: dK_j, dV_j split by columns, Sᵀ / dPᵀ by queries, Pᵀ and dSᵀ through
shared memory); dQ by red.add (ordered when deterministic), or with dq_writer through the Q/dO ring
slot (dQ_i's part staged in the chunks of Q_i, dO_i that only the warpgroup's own dV, dK read,
once they have: dq_bulk's and dq_writer's own staging tiles do not fit next to the tile; the
writer warp's bulk reduce-adds and the consumer threads release the slot; HEURISTIC_D256_DQ_WRITER,
on); roles (name _rol, kRoles: the two warpgroups split by operand instead, Sᵀ / Pᵀ / dV on one,
dPᵀ / dSᵀ / dK on the other, all m64n64 or RS, Pᵀ handed over in shared memory; dq_writer only, plain
unordered calls; HEURISTIC_D256_ROLES, on for bf16 and fp16: 0.95-1.22x cuDNN), with s_ahead (the next Q block's
Sᵀ / dPᵀ behind the dQ GEMM); the lpt order for causal calls (HEURISTIC_D256_LPT); clusters of 2 CTAs
sharing Q/dO by multicast (HEURISTIC_D256_CLUSTER, off: slower); every feature (dropout alone: see
below; features run the query split). Head
dims 129..255 run it with zero-filled columns (192 included: no d192 kernel of its own).
(Dropout runs there alone: with a window, softcap or ALiBi, and overlap_sdp, ptxas spills.)
Schedules (issue 14, the short and causal backward): dynamic (name _dyn, kDynamic: a CTA per SM
claims K/V-block tiles from a plan-owned counter, the next tile's loads overlap the last one's
epilogue; dq_writer and stages 2 only) is the heuristic's for plain calls at d64 and d128
(HEURISTIC_DYNAMIC, measured; d128 with dk_late and frag_pin; d256's shared-keys tile runs one CTA per K/V block: the config
refuses dynamic there); lpt (name _lpt, the longest-first launch order, causal; outside
the space) is off (HEURISTIC_LPT); ds_double (name _ds2, two dS buffers at d128) is on with dk_late
below only; tests/sm90_bwd_causal_timing.py times them.
Main-loop flags (issue 14, the d128 backward at cuDNN's speed; in the space): dq_early (_dqe,
kDqEarly: the dQ GEMM issued behind dV, dK, one wait for the three), dk_late (_dkl, kDkLate, with
dq_early and dq_writer: dK issued behind the dQ GEMM, FlashAttention-3's order, waited for once the
dQ part is staged; with the dynamic scheduler at d128 only with frag_pin: it spills otherwise), s_ahead (_sah, kSAhead: the
next Q block's Sᵀ behind the dQ GEMM; measured slower), q_rotate (_rot, kQRotate, non-causal: K/V
block n starts at Q block n % n_iters), frag_pin (_pin, kFragPin: Pᵀ's fragments pinned at the wgmma
fence, so that dV's k16 steps stay one group; HEURISTIC_FRAG_PIN). The heuristic runs dq_early + dk_late
+ ds_double + frag_pin with the dynamic scheduler for plain unordered d128 calls, dq_early + dk_late on
d64's dynamic tile (HEURISTIC_DK_LATE, HEURISTIC_FRAG_PIN, HEURISTIC_DYNAMIC, measured:
tests/sm90_bwd_d128_timing.py); calls with features run without them (unmeasured there).
Head dim 128 has a second tile, FA3's non-causal one: BM 80 (kDqSwap; bf16, non-causal plain unordered
calls with dq_writer; Sm90BwdConfig.bm80_refused): 80 queries are no whole wgmma m, so the dQ part is
computed transposed, dQ_iᵀ = K_jᵀ dSᵀ (m64n80k16, A transposed), and staged transposed for the writer
warp; outside the tuning space and the heuristic until measured (tests/sm90_bwd_d128_timing.py, bm80).
dq_convert (_dqc, kDqConvert, session 17; with dq_writer, plain unordered fixed-length calls, the d128
dynamic tile or d256's roles): no convert_dq launch; the writer warp counts each tile once its bulk
reduce-adds have completed, a pair's last tile queues its 256-row convert jobs, CTAs whose tiles are
done convert them (Sm90BwdDqQueue; the plan's counter buffer grows to hold the queues). The heuristic's
for d128 causal calls up to 4k (HEURISTIC_DQ_CONVERT). s_ahead is refused and outside
the tuning space (every kernel it builds is serialized by ptxas or spills); every valid point of the space
is recorded clean in tests/sm90_bwd_space_clean.txt (tests/sm90_bwd_space_scan.py).
Feature backwards with the plain call's schedule (session 18): window, softcap and ALiBi at d128 keep the plain
heuristic's fields (FEATURE_SCHED_BUILT; the plain grid where the dynamic kernel spills: feature_sched_spills),
the heuristic's for bf16 (FEATURE_SCHED, measured). Tried and removed (session 18): a score fold for softcap
(its tanh in place in Sᵀ, the mask as t = -inf before the exp2, softcap_out folded into the exponent's FFMA, the
thread words holding Pᵀ ∘ (1 - t²) so that dSᵀ reads one word and no Pᵀ fragment): measured slower (round 2,
bf16 d128 8k, backward x the plain call's, full / causal: 1.110 / 1.085 without it, 1.189 / 1.184 with it;
logs/session18_feat6/r2), and it changed the family's code stamp.
dq_first (_dqf, kDqFirst, session 18; with dq_writer, fixed-length unordered calls where every query row gets
a dQ part: dq_first_covers): the preprocess does not zero the fp32 dQ accumulator (fa2_bwd_preprocess's
kZeroDq false: half its bytes); the first CTA to reach a Q block zeroes its rows during the main kernel
(producer warp 2; a per-Q-block ticket in dq_semaphore's place, which the writer checks before its
reduce-adds). HEURISTIC_DQ_FIRST (up to 2k: d64, d128, d256 causal; fp16 d128 non-causal up to 4k); outside
the tuning space.
wide_epi (_w16, kWideEpi, session 20; plain fixed-length unordered calls): the epilogue stores dK_j, dV_j 16 bytes a
lane (quad_transpose: the four lanes of an accumulator row exchange their column pairs) instead of 4, where the call
is MHA with 16-byte aligned dk, dv (checked in the kernel; else the 4-byte stores); on both epilogues (the generic
one and roles'). HEURISTIC_WIDE_EPI; outside the tuning space. The roles tile also runs on the dynamic scheduler
(dynamic with roles at head dim 256, session 20): built and tested, measured slower (HEURISTIC_D256_DYNAMIC, off;
outside the tuning space).
Not implemented yet: a d96 / d192 kernel of their own (96 runs the d128 kernel), swap-AB elsewhere.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import numpy as np

from ..features import KERNEL_FLAGS, name_suffix, template_suffix
from ..problem import Problem
from ..registry import register
from .base import Family, KernelConfig, LaunchSpec, default_max_smem
from .fa2_bwd import (EPILOGUE_THREADS, PREP_ROWS, PREP_THREADS, ROW_PAD, FA2Backward, bwd_params,
                      contiguous_strides, head_group, varlen_ws_rows)
from .fa2_fwd import check_head_dim, dropout_mix, feature_mix, first_fitting, is_varlen
from . import sm90_fwd
from .sm90_fwd import tensor_map

HEAD_DIMS = (64, 128, 256)
MAX_SMEM = 227 * 1024          # the H100's opt-in maximum per CTA
CU_TENSOR_MAP_DATA_TYPE_F32 = 7   # dq_writer's map of the fp32 dQ accumulator
# 32-bit registers of accumulators and fragments a consumer thread keeps live (see
# Sm90BwdConfig.accum_regs). ptxas (nvcc 13.0, sm_90a) spills nothing up to this under the
# 240 (2 consumers) / 256 (1 consumer) register budget. The sum over-counts (the kernel never
# holds all of them at once): above it only PTXAS_FITS's shapes are allowed, checked by ptxas
# (at the kernel of 2026-11-26 d128 BM64 BN64 c1 compiles clean too; it stays refused, untimed).
MAX_ACCUM_REGS = 256
# (BM, BN, consumers, head_dim) shapes over MAX_ACCUM_REGS that ptxas fits nonetheless (nvcc 13.0,
# sm_90a, zero spills, every flag but dropout; tests/test_sm90_bwd_d64_cpu.py holds it): the sum
# counts Sᵀ, dPᵀ, both fragment sets and the dQ part as live together, while the kernel's order
# never holds them all. BM 128 at head dim 64 (FA3's d64 tile): 288 by the sum, the consumers'
# peak is under their 240 registers.
PTXAS_FITS = frozenset({(128, 128, 2, 64), (80, 128, 2, 128)})
# Head dim 64 (real head dims <= 64): whether rank() puts this family above fa2_bwd, and the
# heuristic's tile there as (BM, BN, consumers). Measured on the H100 (2026-11-26,
# tests/sm90_bwd_d64_timing.py: d64, 32 heads, batch x seqlen 16k, 2k-16k, causal and not, bf16
# and fp16, backward alone): BM128 BN128 c2 with dq_writer 0.85-0.98x SDPA cuDNN's speed,
# 1.26-1.38x fa2_bwd's, 1.35-1.50x the BM64 BN64 c1 kernel's; BM64 BN128 c2 (dQ by 32-column
# halves) 0.78-0.89x cuDNN. Off (False, (64, 64, 1)): the choice before they existed.
D64_ABOVE_FA2 = True
D64_SHAPE = (128, 128, 2)
# Head dims 65..96 (run by the d128 kernel, zero-filled columns): whether rank() puts this
# family above fa2_bwd. Measured there (d96, bf16, same shape and script, --hdim 96): 0.85-0.91x
# SDPA cuDNN's speed, 1.40-1.62x fa2_bwd's.
D96_ABOVE_FA2 = True
# The launch order and scheduler, measured on the H100 (2026-11-26, session 14 round A at 10741ad,
# tests/sm90_bwd_causal_timing.py: bf16, dim 2048, batch x seqlen 16k, 2k-16k, the whole backward
# next to SDPA cuDNN's in one process; results/NVIDIA_H100_80GB_HBM3/sm90_bwd_causal_timing.md):
# * HEURISTIC_DYNAMIC: the (kernel head dim, causal) classes whose plain calls (no feature, not
#   deterministic, not varlen) run the dynamic persistent scheduler (dynamic, kDynamic: a CTA per
#   SM claiming K/V-block tiles, the next tile's loads behind the last one's epilogue, LSE / D by
#   bulk copies). d64: 0.97-1.05x -> 1.07-1.16x cuDNN (non-causal), 1.03-1.04x -> 1.12-1.14x
#   (causal); d128 causal 0.94-0.99x -> 0.96-1.02x; d128 non-causal mixed (2k 0.94 -> 0.93, 4k
#   0.96 -> 0.97, 8k 0.97 -> 0.99, 16k 1.05 -> 1.02): left on the plain grid. An empty set turns it
#   off (the plain grid for every call).
# * HEURISTIC_LPT: whether causal calls launch in the longest-first order (lpt, kLpt: K/V block 0
#   of a group of pairs first, fa2_bwd's order): off, measured no faster (static: -2..+3%; with
#   the dynamic scheduler -3..+2% against the dynamic plain order).
# * HEURISTIC_DS_DOUBLE: two dS buffers at head dim 128 (ds_double, kDsDouble: no barrier between
#   the consumer warpgroups before the dS stores) for every d128 call: off; plain d128 calls take it
#   with dk_late (HEURISTIC_DK_LATE below, measured; alone it was -1..+4%, session 15 round A).
# Session 16 (round B at 8f7ff6c, tests/sm90_bwd_d128_timing.py, b2b, rotated order; logs/session16_rounds/b1):
#   d128 joined with dk_late (which fits there with frag_pin only: HEURISTIC_FRAG_PIN), x cuDNN at 2k / 4k /
#   8k / 16k, against the plain-grid dk_late kernel: bf16 non-causal 0.961 / 0.974 / 0.994 / 1.035 -> 0.983 /
#   1.001 / 1.028 / 1.040, causal 0.984 / 1.008 / 1.014 / 1.005 -> 1.010 / 1.035 / 1.032 / 1.052; fp16
#   non-causal 0.954 / 0.960 / 0.991 / 1.022 -> 0.981 / 1.000 / 1.026 / 1.021, causal 0.987 / 1.020 / 1.064 /
#   1.058 -> 1.008 / 1.026 / 1.030 / 1.044 (its GPU tests: odd shapes, 528 tiles, passed there).
HEURISTIC_DYNAMIC = frozenset({(64, False), (64, True), (128, False), (128, True)})
# * DYNAMIC_MAX_SEQLEN_BY, (kernel head dim, causal, dtype): the longest seqlen_q at which a class of
#   HEURISTIC_DYNAMIC keeps the dynamic scheduler (longer: the plain grid, the rest of the heuristic's fields
#   kept). fp16 d128 causal: the plain grid's kernel (dq_early, dk_late, ds_double, frag_pin) against the
#   dynamic one, x cuDNN at 8k / 16k: session 16 round B 1.064 / 1.058 against 1.030 / 1.044; session 19's
#   tune (CuPy path, logs/session19_rounds/l1) +1.3% / +4.3%; session 19 round 2 (b2b, same process as
#   cuDNN; logs/session19_bwd15/r2.log) 1.029 / 1.060 against 1.024 / 1.043, round 3 (as shipped, r3.log)
#   1.049 / 1.057 against 1.026 / 1.033. (bf16 causal: the dynamic kernel wins at every seqlen, session 16.)
DYNAMIC_MAX_SEQLEN_BY: dict = {(128, True, "fp16"): 4096}
# The schedule of a window-only call's backward (features ("window",), fixed lengths, not
# deterministic), by kernel head dim: the config fields over the heuristic's; a head dim not
# listed keeps the plain grid at stages 2. Measured on the H100 (tests/features_overhead_timing.py,
# bf16 d128 8k, batch 2 x 16 heads, window 1024; forward + backward time over the plain call's,
# over the window's visible fraction, causal / full): stages 2 1.64 / 1.39, stages 3 1.59 / 1.34
# (1.56 / 1.30 in session 14), stages 3 + overlap_sdp 1.57 / 1.29, the dynamic scheduler (stages
# 2: a CTA per SM claiming K/V blocks, the next block's loads behind the last one's epilogue; a
# window's K/V block visits few Q blocks, so the per-block start weighs more) 1.51 / 1.23
# (results/NVIDIA_H100_80GB_HBM3/features_overhead_session15.md, round A). Round B: dynamic 1.52 /
# 1.33, + two dS buffers (ds_double) 1.51 / 1.25, + overlap_sdp 1.54 / 1.31, stages 3 1.53 / 1.28:
# dynamic with ds_double.
WINDOW_BWD = {128: dict(dynamic=True, ds_double=True)}
# The feature sets whose calls keep a config's dynamic scheduler (WINDOW_BWD, bwd_config=, a tuned
# entry; the heuristic sets it for plain calls and through WINDOW_BWD): a window alone at the head
# dims of WINDOW_BWD (run by tests/test_feature_defaults_gpu.py); any other call with features keeps
# the plain grid.
DYNAMIC_FEATURES = frozenset({("window",)})
# A window-only backward's dQ and epilogue paths, by (kernel head dim, dtype), each where measured better:
# * WINDOW_DQ_FIRST: dq_first (the dQ accumulator zeroed by the first K/V block to reach a Q block, not by the
#   preprocess: a fixed ~45 us at batch 2 x 16 heads x 8k, d128, against a window backward of ~0.9 ms), where
#   every Q block gets a dQ part (dq_first_covers with the call's bounds: for_bounds drops it per call);
# * WINDOW_WIDE_EPI: wide_epi (16-byte dK / dV epilogue stores, MHA; the kernel checks MHA and alignment per
#   call): the epilogue is per K/V tile, and a window's tile visits few Q blocks (17 at 1024, BM 64);
# * WINDOW_DQ_CONVERT: dq_convert (the dQ convert inside the main kernel, no third launch).
# Measured (session 21, win3, round 1: tests/features_overhead_timing.py --quick --mask both --features window
# --bwd-pass, bf16 d128 batch 2 x 16 heads x 8k, window 1024 causal / 1024 x 1024 full, x the plain call in
# the same process over the visible share; on an H200; results/NVIDIA_H200/logs/session21_win3/round1.md), backward alone, causal /
# full: the heuristic before 1.420 / 1.223, dq_first 1.391 / 1.204, wide_epi 1.322 / 1.174, both 1.278 /
# 1.157, both + dq_convert 1.324 / 1.163; forward + backward 1.512 / 1.300 -> both 1.416 / 1.233 (+ dq_convert
# 1.447 / 1.240). dq_first and wide_epi on for bf16 d128 (fp16 not measured); dq_convert off. Round 3 (as shipped,
# round3.md): backward alone 1.408 / 1.236 -> 1.273 / 1.159, forward + backward 1.508 / 1.287 -> 1.414 / 1.230.
WINDOW_DQ_FIRST: frozenset = frozenset({(128, "bf16")})
WINDOW_WIDE_EPI: frozenset = frozenset({(128, "bf16")})
WINDOW_DQ_CONVERT: frozenset = frozenset()
# * WINDOW_DQ_TAIL: dq_tail's form by (kernel head dim, dtype, causal) (session 31: the dQ convert as a
#   programmatic dependent of the dynamic main kernel, sm90_bwd_dq_tail, whose CTAs convert the pairs whose K/V
#   tiles are done on the SMs the grid's end leaves idle). H200 (results/NVIDIA_H200/logs/session31_win5), bf16
#   d128 2 x 16 heads x 8k, window 1024 x 1024 / (1024, 0) causal, the backward alone, ms, without -> form 1 /
#   form 2: round 1 (an earlier convert kernel, two barriers a job; tests/features_overhead_timing.py --bwd-pass)
#   full 1.410 -> 1.381, causal 0.854 -> 0.873; round 2 (tests/window_bwd_kernels_timing.py) full 1.378 -> 1.347
#   / 1.344, causal 0.807 -> 0.805 / 0.808; round 3, features timing: full 1.372 -> 1.345 / 1.345 (forward +
#   backward 1.982 -> 1.960 / 1.960), causal 0.870 -> 0.862 / 0.860 (1.216 -> 1.213 / 1.207); round 3, per-kernel
#   timing: full 1.385 -> 1.356 / 1.356, causal 0.814 -> 0.809 / 0.802. The full window's 34-Q-block tiles leave
#   a long tail of idle SMs; the causal grid ends on the last pair's short tiles (a K/V block near the sequence's
#   end sees few Q blocks), so less of its convert hides (~1%). Form 2 on for both.
WINDOW_DQ_TAIL: dict = {(128, "bf16", False): 2, (128, "bf16", True): 2}
# The feature backward with the plain call's schedule (issue 12 / 14: a feature's backward at the plain
# call's speed). FEATURE_SCHED_FLAGS are the plain heuristic's schedule fields (the dynamic scheduler,
# two dS buffers, the dQ GEMM early, dK late, Pᵀ's fragments pinned); FEATURE_SCHED_BUILT the feature
# sets (by kernel head dim) whose kernels with them are built and checked: zero spills, no wgmma
# serialization (nvcc 13.0, sm_90a; BM 64, 2 consumers, dq_writer, bf16 / fp16, causal or not:
# tests/test_bwd_feature_sched_cpu.py), so that bwd_config= and tuned entries keep those fields there.
# FEATURE_SCHED, by (kernel head dim, dtype): the feature sets whose heuristic takes the plain call's schedule
# fields (where the config builds them: the plain grid where the dynamic kernel spills, feature_sched_spills).
# Measured on the H100 (session 18 round 1, tests/sm90_bwd_features_timing.py: bf16 d128, batch 2 x 16 heads
# x 8k, backward alone over the plain call's, same process; results/NVIDIA_H100_80GB_HBM3/logs/session18_feat6):
# full / causal, the heuristic before -> with the plain fields: ALiBi 1.094 / 1.104 -> 1.016 / 1.031 (the plain
# grid's 1.032 / 1.033), forward + backward 1.090 / 1.085 -> 1.045 / 1.034; window 1024 x its visible share
# 1.286 / 1.552 -> 1.270 / 1.482 (the plain grid 1.322 / 1.559), forward + backward 1.350 / 1.620 -> 1.337 /
# 1.575; softcap 30 1.242 / 1.264 -> 1.114 / 1.136, forward + backward 1.250 / 1.236 -> 1.154 / 1.134 (round 2:
# 1.223 / 1.230 -> 1.110 / 1.085, 1.187 / 1.265 -> 1.103 / 1.122). (Round 1's softcap GPU test failure, dQ at
# 17 x 1, is the forward's: its fixed running max leaves the one visible key's P != 1, rounded in P V and not in
# l; every softcap backward, the shipped one too, had it: tests/bwd_feature_sched_diag.py, round 2.) Round 3, as
# shipped (rev 4ab1de1; its GPU tests, 15, passed; synccheck 0 errors), backward x plain / forward + backward x plain,
# full / causal: softcap 1.106 / 1.121, 1.176 / 1.135; ALiBi 1.001 / 0.994, 1.068 / 1.053; window x visible 1.261 /
# 1.450, 1.357 / 1.582. A window's
# dq_convert next to the plain fields (built in bf16, zero spills; round 2): bwd x visible 1.259 / 1.440 -> 1.245 /
# 1.478, forward + backward 1.318 / 1.563 -> 1.285 / 1.587: mixed, not kept (for_problem drops it with features).
FEATURE_SCHED_FLAGS = ("dynamic", "ds_double", "dq_early", "dk_late", "frag_pin")
FEATURE_SCHED_BUILT = {128: frozenset({("softcap",), ("alibi",), ("window",)})}
FEATURE_SCHED: dict = {(128, "bf16"): frozenset({("alibi",), ("softcap",), ("window",)})}
HEURISTIC_LPT = False
HEURISTIC_DS_DOUBLE = False
# Head dim 256 (the shared-keys tile, head dims 129..256; issue 14's d256 round): whether the
# heuristic adds, measured on the H100 (session 15 round A, rev 54171d7, tests/sm90_bwd_d256_timing.py:
# d256, 8 heads, batch x seqlen 16k, 2k-16k, causal and not, bf16 and fp16, backward alone, same
# process as SDPA cuDNN; results/NVIDIA_H100_80GB_HBM3/logs/session15_rounds/a/bwd256.log):
# * HEURISTIC_D256_DQ_WRITER: dq_writer (unordered calls): dQ_i's part staged in the ring slot of
#   Q_i, dO_i once dV, dK have read it (no tile of its own fits: Sm90BwdSlotDqStage), added by the
#   writer warp's tensor bulk reduce-adds, which then release the slot, instead of the consumers'
#   red.add: faster in all 16 cells, non-causal 1.01-1.05x, causal 1.05-1.10x (cuDNN ratio 0.81-0.89
#   -> 0.85-0.91 non-causal, 0.77-0.83 -> 0.83-0.89 causal). Session 15's racecheck found a WAR on
#   the LSE row of a ring slot (session 16 with source lines: the producer's cp.async refill vs the
#   consumers' LSE reads, the slot released by the writer warp's arrival alone, through a named
#   barrier); the consumer threads now release the slot themselves too (q_empty counts them and the
#   writer), and racecheck of the dq_writer kernels (plain, cluster, roles; tests/sm90_bwd_d256_race.py)
#   reports 0 hazards (session 16 round A, rev 00edc4f, logs/session16_rounds/b256_round_a.md): on.
# * HEURISTIC_D256_LPT: the lpt launch order for causal calls: slower in 7 of 8 cells (red.add
#   0.96-0.98x, with dq_writer 0.94-1.02x: only bf16 16k gained): off.
HEURISTIC_D256_DQ_WRITER = True
HEURISTIC_D256_LPT = False
# * HEURISTIC_D256_CLUSTER: clusters of 2 CTAs sharing the Q/dO loads by multicast (cluster, kCluster),
#   built for the L2 -> SM traffic of Q_i, dO_i (64 KB per Q block for 64 keys; ncu, session 15: L2
#   66%, tensor pipe 36%). Measured slower (session 16 round A, bf16 2k-16k, x cuDNN): dq_writer
#   0.82-0.89 -> 0.73-0.80 in the cluster, roles 0.98-1.16 -> 0.82-0.94: off.
HEURISTIC_D256_CLUSTER = False
# * HEURISTIC_D256_ROLES, the dtypes whose plain unordered calls run roles (kRoles: the consumer
#   warpgroups split by operand, Sᵀ / Pᵀ / dV on one, dPᵀ / dSᵀ / dK on the other, m64n64 Sᵀ and dPᵀ,
#   dV and dK by RS: fewer shared-memory bytes per Q block than the query split's m64n32 products and
#   SS dV, dK), with dq_writer (roles is built with it only). Measured in bf16 (session 16 rounds A / B,
#   revs 00edc4f / 974c95b, x cuDNN's speed at 2k / 4k / 8k / 16k; logs/session16_rounds/b256_round_*.md):
#   non-causal dq_writer 0.86 / 0.82 / 0.89 / 0.88 -> roles 1.03 / 1.00 / 1.10 / 1.16 (A), 1.02 / 1.09 /
#   1.10 / 1.11 (B), 358-427 TFLOPs; causal 0.87 / 0.85 / 0.82 / 0.87 -> 0.98 / 1.01 / 0.99 / 1.05 (A),
#   0.97 / 0.99 / 0.95 / 1.04 (B), 300-425 TFLOPs: on for bf16. fp16 (round C, rev 1c09956,
#   logs/session16_rounds/c1/b256.log): non-causal dq_writer 0.86 / 0.89 / 0.90 / 0.90 -> roles 1.05 /
#   1.17 / 1.15 / 1.22, causal 0.89 / 0.87 / 0.84 / 0.87 -> 1.00 / 1.08 / 1.11 / 1.16 (the same run's
#   bf16: 0.98-1.16): on for fp16 too. With s_ahead (round B): 0.81-0.90, slower than roles alone; in clusters of 2 CTAs
#   0.82-0.92 (A, B), with s_ahead 0.65-0.74: neither in the heuristic.
HEURISTIC_D256_ROLES = frozenset({"bf16", "fp16"})
# * HEURISTIC_D256_DYNAMIC, {(causal, dtype): shortest seqlen_q}: the classes whose roles calls (plain, unordered,
#   fixed lengths) run the dynamic scheduler (session 20: kDynamic with kRoles, a CTA per SM claiming K/V-block
#   tiles, the next tile's K_j, V_j loads behind the last one's epilogue; the plain grid starts one CTA per K/V
#   block, 2048 at batch x seqlen 16k, each with its loads and pipeline fill exposed). Measured slower (session 20
#   round 1, rev f84f2ab, bf16 causal, x cuDNN heur -> dyn; logs/session20_bwd16/r1.md): 8k 1.028 -> 1.003 and
#   1.044 -> 0.993 (GPU us, main kernel 3344 -> 3494), 2k (with dq_first) 1.030 -> 1.010; its GPU tests (8, odd
#   shapes, more tiles than SMs) passed. Off.
HEURISTIC_D256_DYNAMIC: dict = {}
# The main-loop flags of issue 14 (the d128 backward at cuDNN's speed), for plain unordered calls
# (no feature, not deterministic) of the classes listed. Measured on the H100 (2026-11-26, session 15
# round A at b082f22, tests/sm90_bwd_d128_timing.py: d128, dim 2048, batch x seqlen 16k, 2k-16k,
# bf16 and fp16, backward alone next to SDPA cuDNN, b2b = the bench's 10-call samples / flush = L2-
# flushed single calls; logs/session15_bwd128/round_a.md), x cuDNN at 2k / 4k / 8k / 16k, b2b:
# * HEURISTIC_DK_LATE, (kernel head dim, causal): dq_early + dk_late (kDkLate: dK issued behind the
#   dQ GEMM, FlashAttention-3's order, waited for once the dQ part is staged) + ds_double, at d128
#   on the plain grid (its dynamic kernel spills). bf16 non-causal 0.942 / 0.951 / 0.984 / 0.996 ->
#   0.988 / 1.026 / 1.012 / 1.066 (16k: 555 TFLOPs; flush 571); causal (was dynamic) 0.965 / 0.987 /
#   0.980 / 1.004 -> 0.983 / 1.032 / 1.052 / 1.058; fp16 non-causal 0.921 / 0.926 / 0.950 / 0.999 ->
#   0.953 / 0.964 / 0.991 / 0.993, causal 0.956 / 0.964 / 0.960 / 1.003 -> 0.992 / 1.003 / 1.046 /
#   1.095. So d128 causal leaves HEURISTIC_DYNAMIC (its best dynamic kernel, dq_early + ds_double,
#   was 0.979 / 1.061 / 1.043 / 1.024 in bf16). Round B (rev 16050ad, the heuristic as shipped here,
#   logs/session15_bwd128/round_b.md), b2b: bf16 non-causal 0.965 / 0.980 / 1.020 / 1.021, causal
#   0.988 / 0.995 / 1.012 / 1.016; fp16 non-causal 0.948 / 0.968 / 1.042 / 1.011, causal 0.991 /
#   1.032 / 1.091 / 1.057 (the session-14 kernel in the same run: 0.91-1.01). Head dim 64 (not in the
#   set yet: its odd-shape GPU tests, tests/test_sm90_bwd_d128_gpu.py::test_d64_dk_late_odd_seqlens,
#   have not run): dq_early + dk_late on its dynamic tile, bf16, 1.043 / 1.083 / 1.099 / 1.113 ->
#   1.091 / 1.143 / 1.139 / 1.119 non-causal, 1.121 / 1.124 / 1.123 / 1.167 -> 1.165 / 1.181 / 1.196
#   / 1.195 causal; fp16 non-causal with q_rotate too 0.995 / 0.990 / 1.013 / 1.024 -> 1.032 / 1.043 /
#   1.064 / 1.046.
# * HEURISTIC_DQ_EARLY, (kernel head dim, causal): dq_early alone (kDqEarly: the dQ GEMM issued
#   behind dV, dK without waiting for them): -2.8..+5.3% alone at d128; on through DK_LATE there.
# * HEURISTIC_S_AHEAD, (head dim, causal, dtype): s_ahead (kSAhead, the next Q block's Sᵀ issued
#   behind the dQ GEMM; d128 bf16 only: the others spill): 0.77-0.87x cuDNN, 13-20% slower: off.
# * HEURISTIC_Q_ROTATE, kernel head dims: q_rotate (kQRotate, non-causal: K/V block n from Q block
#   n % n_iters on): -0.5..+3.9% (b2b), +0.1..-0.2% (flush): off; on top of dk_late (round B) -2.6..+2.1%.
#   Entries: a kernel head dim, or (head dim, dtype). Session 16 round C (at 1c09956, as below), q_rotate on
#   d64's dk_late kernel ("hrot"), x cuDNN at 2k / 4k / 8k / 16k: fp16 0.975 / 0.995 / 0.996 / 1.026 ->
#   1.039 / 1.023 / 1.058 / 1.113; bf16 1.144 / 1.136 / 1.143 / 1.074 -> 1.138 / 1.124 / 1.134 / 1.139: fp16.
# * HEURISTIC_DK_LATE (session 16): head dim 64 joined (session 16, round A at d65554e, tests/sm90_bwd_d128_timing.py --hdim 128 64, b2b, rotated
#   order; logs/session16_rounds/a2): its odd-shape GPU tests (test_d64_dk_late_odd_seqlens, bf16 / fp16, both
#   masks) passed; dq_early + dk_late on its dynamic BM128 tile, x cuDNN at 2k / 4k / 8k / 16k, bf16 non-causal
#   1.069 / 1.066 / 1.085 / 1.153 -> 1.110 / 1.122 / 1.171 / 1.205, causal 1.115 / 1.150 / 1.139 / 1.197 ->
#   1.167 / 1.222 / 1.200 / 1.251; fp16 non-causal 0.999 / 0.977 / 1.008 / 1.103 -> 0.986 / 0.989 / 1.054 /
#   1.116, causal 1.056 / 1.059 / 1.056 / 1.100 -> 1.104 / 1.116 / 1.119 / 1.147.
HEURISTIC_DK_LATE = frozenset({(128, False), (128, True), (64, False), (64, True)})
HEURISTIC_DQ_EARLY = frozenset()
HEURISTIC_S_AHEAD = frozenset()
HEURISTIC_Q_ROTATE = frozenset({(64, "fp16")})
# * HEURISTIC_FRAG_PIN, (kernel head dim, causal): frag_pin (kFragPin: Pᵀ's A fragments pinned at the
#   wgmma fence before dPᵀ and dV). Without it ptxas (nvcc 13.0) copies one fragment after the fence in
#   every d64 / d128 kernel of the heuristic and injects a warpgroup.arrive before each of dV's four
#   k16 steps (C7519), each closing its own group: the wait for dPᵀ (wgmma_wait<1>) then also waits
#   for three of dV's four steps, so dSᵀ's math does not overlap dV. With it dV is one group (SASS
#   checked; zero spills in the 12 heuristic kernels d64 / d128 x bf16 / fp16 x causal or not, and
#   d64's dk_late ones). It also makes room for dk_late with the dynamic scheduler at d128 (16 bytes of
#   spills without it, none with it: bf16 / fp16, causal or not). Off until measured
#   (tests/sm90_bwd_d128_timing.py, variants *_pin, dyn_pin). Measured alone (session 16 round A, as above):
#   d128 -1.0..+1.1% (bf16 / fp16, both masks: noise), d64 bf16 -3..-12% (slower: left off), d64 fp16
#   -0.1..+5.8%; on top of d64's dk_late -0.4..+1.3% fp16, -6..-12% bf16. Its use: dk_late with the dynamic
#   scheduler at d128 (dyn_pin, round B: HEURISTIC_DYNAMIC's numbers), so d128's plain calls take it.
HEURISTIC_FRAG_PIN = frozenset({(128, False), (128, True)})
# * HEURISTIC_BM80: whether plain bf16 non-causal d128 calls run the BM 80 tile (kDqSwap, FA3's tile
#   there: 25% more queries per Q block, dQ_iᵀ = K_jᵀ dSᵀ; with the heuristic's dq_early / dk_late /
#   ds_double, without frag_pin: that kernel spills). Round B (session 16; its GPU tests passed): x cuDNN
#   0.915 / 0.928 / 0.962 / 0.968 at 2k / 4k / 8k / 16k against the plain-grid BM 64 kernel's 0.951 / 0.982 /
#   0.999 / 1.034: slower, off.
HEURISTIC_BM80 = False
# * HEURISTIC_STAGES3, (kernel head dim, causal, dtype): 3 Q/dO ring slots on the plain grid (one dq_writer
#   staging tile then: 227 KB) for plain unordered calls of the classes listed. Round A (session 16, with
#   frag_pin: s3_pin) x cuDNN fp16 non-causal 0.943 / 0.958 / 0.989 / 1.010 -> 0.967 / 0.991 / 1.015 /
#   1.021, bf16 non-causal -0.9..+2.3%, causal -0.8..-3.6%; below the dynamic scheduler's (HEURISTIC_DYNAMIC,
#   round B) in those cells but 8k-16k. Off.
HEURISTIC_STAGES3 = frozenset()
# dq_convert (kDqConvert, name _dqc, session 17): the dQ convert (dQ = scale · accumulator) inside the main
# kernel instead of fa2_bwd_convert_dq's launch: the writer warp counts each tile once its bulk reduce-adds
# have completed, a pair's last tile queues its DQ_CONVERT_ROWS-row jobs, and CTAs whose tiles are done
# (the dynamic scheduler's idle SMs at the end of the grid; in the plain grid each CTA at its end) convert
# them (Sm90BwdDqQueue, kernels_cu/sm90_bwd.cu). At 2k the convert launch was 68 us of a 1.25-1.46 ms
# backward (results/NVIDIA_H100_80GB_HBM3/logs/bwdpre_round_a3, d128 bf16).
# * HEURISTIC_DQ_CONVERT, (kernel head dim, causal, dtype): the classes whose plain unordered calls take it
#   (head dim 128 with the dynamic scheduler, 256 with roles). Off until measured (tests/sm90_bwd_2k_timing.py).
#   Round 1 (session 17, rev 552cee8: one queue, jobs taken by compare-and-swap, 2 loads in flight a thread),
#   x cuDNN at 2k / 4k, heur -> dq_convert: d128 bf16 non-causal 0.995 / 0.987 -> 0.804 / 0.865, causal 1.010 /
#   1.029 -> 0.724 / 0.854, fp16 0.978 / 0.973 -> 0.798 / 0.905, 0.996 / 1.000 -> 0.721 / 0.851; d256 bf16
#   1.047 / 1.111 -> 1.038 / 1.079, causal 0.981 / 1.061 -> 0.922 / 0.986, fp16 1.087 / 1.145 -> 1.069 / 1.124,
#   causal 1.019 / 1.078 -> 0.948 / 0.998. The d128 main kernel took 1630 us for 1196 + 68 of convert (the
#   idle CTAs' compare-and-swaps on one queue head: one success per round trip; and too few loads in
#   flight per SM). Round 2 (rev 42d8854: kQueues heads, batches of 8 items' loads), heur -> dq_convert: d128
#   bf16 non-causal 0.983 / 1.001 -> 0.973 / 0.995, causal 1.000 / 1.011 -> 1.024 / 1.070; fp16 non-causal
#   0.983 / 0.995 -> 0.999 / 1.016, causal 0.969 / 1.024 -> 0.963 / 1.064 (per-kernel: the convert's 68 us go,
#   the main kernel grows 14-88 us non-causal, shrinks 64 us at causal 4k, where the dynamic scheduler's
#   uneven tail leaves SMs idle earlier); d256 (plain grid, roles) slower in all 8 cells (0.86-1.14 against
#   0.98-1.18): off there. On for d128 causal (bf16, fp16) and fp16 non-causal, up to DQ_CONVERT_MAX_SEQLEN
#   (measured at 2k and 4k only; longer sequences have fewer, larger pairs, converted at the end).
#   Round 3 (rev b16cda3, as switched on; nodqc = the same kernel without it), x cuDNN at 2k / 4k: bf16 causal
#   0.985 / 1.027 -> 1.014 / 1.062, fp16 causal 0.981 / 1.016 -> 1.003 / 1.048, fp16 non-causal 0.978 / 0.996
#   -> 0.968 / 1.008 (with round 2: +0.3% / +1.6%); at 8k / 16k dq_convert against the heuristic's kernel:
#   bf16 causal 1.044 / 1.048 -> 1.011 / 1.055, non-causal 1.017 / 1.017 -> 1.014 / 1.008, fp16 causal 1.032 /
#   1.043 -> 0.996 / 1.049, non-causal 1.011 / 1.011 -> 1.025 / 1.032: mixed, so the 4k cap stays.
#   Session 19: fp16 non-causal left (its kernel spills 4 bytes, nvcc 13.0; dq_first without dq_convert there
#   as fast: HEURISTIC_DQ_FIRST below).
HEURISTIC_DQ_CONVERT = frozenset({(128, True, "bf16"), (128, True, "fp16")})
DQ_CONVERT_MAX_SEQLEN = 4096
# dq_first (kDqFirst, name _dqf, session 18): the preprocess leaves the fp32 dQ accumulator unzeroed (half
# of its bytes: at batch x seqlen 16k, dim 2048, 128 MB of zeros, about 45 us of its 95), and the first CTA
# to reach a Q block zeroes its rows while the main kernel computes (producer warp 2, otherwise idle: the Q
# block's ticket in dq_semaphore taken 0 -> 1 by compare-and-swap, published 2 once the zeros are fenced;
# the writers wait for 2 before their reduce-adds). Calls where some query row gets no part (causal with
# seqlen_q > seqlen_k, windows, varlen) keep the zeroed accumulator (dq_first_covers).
# Round 1 (session 18, rev 4608b7b, an earlier form: the first CTA's writer stored its dQ part by a tensor
# bulk store, the others waited for the store to complete), x cuDNN heur -> dq_first, 2k / 4k: d128 bf16
# non-causal 0.987 / 1.004 -> 1.007 / 1.002, causal 1.023 / 1.067 -> 1.071 / 1.109; fp16 non-causal 0.979 /
# 1.008 -> 1.007 / 1.020, causal 1.005 / 1.059 -> 1.058 / 1.075; d256 (roles) bf16 non-causal 1.078 / 1.096
# -> 1.028 / 1.046, causal 0.998 / 1.052 -> 1.023 / 1.030, fp16 non-causal 2k 1.084 -> 1.030 (the waits for
# the store held the ring slot that d256 stages dQ in).
# Round 3 (rev e08148d, this form; its 39 GPU tests passed, racecheck 0 hazards, synccheck 0 errors on
# tests/sm90_bwd_dqfirst_sanitize.py --quick), x cuDNN at 2k, heur -> dq_first: d128 bf16 non-causal 0.992 ->
# 1.004, causal 1.026 -> 1.060; fp16 non-causal 0.992 -> 0.983 (0.991 without dq_convert), causal 1.011 ->
# 1.042; d256 bf16 non-causal 1.038 -> 1.005 (slower again: off at d256). Longer sequences not measured in
# this form (the preprocess's saving is a fixed ~45 us: 3% at 2k, under 1% from 8k): capped at 2k.
# Session 19 (tests/sm90_bwd_2k_timing.py --cells, b2b, 5 rotated samples, x cuDNN in the same process; logs/
# session19_bwd15/r1.log at rev 6516728, r2.log at 70c7721), without -> with dq_first:
# * d256 causal (roles): bf16 2k 0.980 -> 1.008 (r1; GPU us: preprocess 98 -> 55, main 972 -> 977), 0.970 -> 0.995
#   (r2), fp16 2k 1.009 -> 1.036 (r1); above 2k within the noise: 4k bf16 1.065 -> 1.071, fp16 1.076 -> 1.070; 8k
#   1.036 -> 1.042, 1.082 -> 1.070; 16k bf16 1.105 -> 1.129. On up to 2k (the preprocess's saving is a fixed
#   ~43 us). lpt (alone or with dq_first) 0.90-0.97 at 2k: off (HEURISTIC_D256_LPT).
# * fp16 d128 non-causal (its dq_convert kernel spills 4 bytes, nvcc 13.0; HEURISTIC_DQ_CONVERT): dq_convert /
#   neither / dq_first at 2k 0.995 / 0.988 / 1.001 (r1), 0.997 / 0.989 / 1.011 and 0.993 / 0.985 / 1.009 (r2,
#   two passes); 4k 1.005 / 0.987 / 1.001 (r1), 1.015 / 0.997 / 1.010 (r2); GPU us at 2k pre + main + convert
#   93 + 1303 / 95 + 1223 + 67 / 55 + 1225 + 68 (cuDNN 94 + 1205 + 74; its b2b samples spread 4-10%: the fp16
#   d128 cells run at the power limit). dq_first in place of dq_convert up to 4k.
# * d64 (the BM 128 dynamic tile) at 2k: bf16 non-causal 1.096 -> 1.125, fp16 non-causal 1.028 -> 1.093, fp16
#   causal 1.104 -> 1.128 (r2); bf16 causal 1.150 -> 1.212 (r3); bf16 causal 4k 1.181 -> 1.163 (r2): on up to 2k.
# * d128 at 4k (r2): bf16 causal 1.060 -> 1.080, fp16 causal 1.062 -> 1.065, bf16 non-causal 1.003 -> 0.996:
#   the 2k cap stays.
# Round 3 (rev 7800b98, as shipped but bf16 d64 causal; r3.log), without -> with: d256 causal 2k bf16 0.980 ->
# 1.007, fp16 0.994 -> 1.020; fp16 d128 non-causal 2k (dq_convert / neither / dq_first) 0.986 / 0.995 / 1.015;
# d64 2k bf16 non-causal 1.113 -> 1.137, fp16 1.038 -> 1.061, fp16 causal 1.108 -> 1.140. Its GPU tests (dq_first
# at odd shapes, the d64 classes, fp16 non-causal with q_rotate among them) passed.
# * HEURISTIC_DQ_FIRST, (kernel head dim, causal, dtype): the classes whose plain unordered dq_writer calls
#   take it, up to DQ_FIRST_MAX_SEQLEN or the class's own cap in DQ_FIRST_MAX_SEQLEN_BY (None: every seqlen).
HEURISTIC_DQ_FIRST: frozenset = frozenset({(128, False, "bf16"), (128, True, "bf16"), (128, True, "fp16"),
                                           (128, False, "fp16"), (256, True, "bf16"), (256, True, "fp16"),
                                           (64, False, "bf16"), (64, False, "fp16"), (64, True, "bf16"),
                                           (64, True, "fp16")})
DQ_FIRST_MAX_SEQLEN = 2048
DQ_FIRST_MAX_SEQLEN_BY: dict = {(128, False, "fp16"): 4096}
# wide_epi (kWideEpi, name _w16, session 20): the epilogue stores dK_j, dV_j 16 bytes a lane (quad_transpose: the
# four lanes of an accumulator row exchange their column pairs) instead of 4, for plain fixed-length unordered
# MHA calls with 16-byte aligned dk, dv. Session 19 (bwd15, round 4, every MHA kernel, reverted for want of a
# round): fp16 d128 non-causal 2k 1.070 vs 1.001 x cuDNN (one pass), d256 causal 2k no change (bf16 1.016 vs
# 1.017: that form changed the generic epilogue only, which the roles kernel does not run); the d128 ALiBi kernel
# spilled 8 bytes with it, so it is a flag now, plain calls only.
# * HEURISTIC_WIDE_EPI, (kernel head dim, causal, dtype): the classes whose plain MHA calls take it, up to the
#   class's cap in WIDE_EPI_MAX_SEQLEN_BY (absent: every seqlen). Measured on the H100 (tests/sm90_bwd_2k_timing.py
#   --cells, b2b 10-call samples in rotated order, median, x SDPA cuDNN in the same process; dK, dV bitwise equal
#   with and without it; logs/session20_bwd16/), without -> with wide_epi:
#   round 1 (rev f84f2ab, two passes): bf16 d128 non-causal 2k 0.990 -> 1.074, 1.002 -> 1.085 (GPU us, main kernel
#   1347 -> 1161); 8k 1.027 -> 1.044 (main 5446 -> 5087); bf16 d256 causal 8k (roles) 1.028 -> 1.071, 1.044 ->
#   1.059 (main 3344 -> 3228);
#   round 2 (rev 48b04d2, the same kernels): bf16 d128 non-causal 2k 0.988 -> 1.039, 8k 1.015 -> 1.024; bf16 d256
#   causal 8k 1.049 -> 1.078; fp16 d128 non-causal 2k 0.965 -> 1.065; bf16 d128 causal 2k 1.039 -> 1.123.
#   On for those four classes (every seqlen: the gain is the epilogue's, per K/V tile). The other eight (the four d64
#   classes, fp16 d128 causal, d256 non-causal in both dtypes, fp16 d256 causal) were not reached in round 2 (its time
#   ran out): they keep the 4-byte stores until measured (their kernels compile clean with it:
#   tests/test_sm90_bwd_wide_dyn_cpu.py).
#   Session 30 (sb1, issue 12's short sequences; one H200, tests/short_seq_timing.py, the backward alone x the
#   heuristic without it in the same process, processes A / B; results/NVIDIA_H200/logs/session30_sb1/r2): d64 bf16
#   non-causal 64 x 197 x 12 heads 0.884 / 0.890, 128 x 128 x 12 0.926 / 0.922, 32 x 512 x 12 0.871 / 0.873,
#   64 x 577 x 16 0.905 / 0.905, 8 x 2048 x 32 0.965 / 0.963, 2 x 8192 x 32 0.999 / 0.995; fp16 non-causal (A)
#   64 x 197 0.881, 8 x 2048 0.925: on for both (d64 causal unmeasured: off). Its GPU tests (tests/test_short_seq_gpu.py)
#   and memcheck / racecheck / synccheck (tests/short_seq_sanitize.py) there. Round 4 (as shipped, the host alone; r4):
#   256 x 197 x 12 0.872 / 0.873, 256 x 128 x 12 0.858 / 0.856, 128 x 512 x 12 0.865 / 0.859, 64 x 577 x 16 0.899 /
#   0.904, 8 x 2048 x 32 0.972 / 0.965, 2 x 8192 x 32 1.012 (B; r2 0.999 / 0.995); fp16 256 x 197 0.877 (B). Up to
#   2048 queries only (WIDE_EPI_MAX_SEQLEN_BY): at 8k it measured no faster.
#   Session 31 (sb2, GPT-2-style causal d64; one H200, the same script, x the heuristic without it, processes A / B;
#   results/NVIDIA_H200/logs/session31_sb2/r1, r2): bf16 causal r1 32 x 512 x 12 0.885 / 0.884, 32 x 1024 x 12
#   0.908 / 0.902 (32 x 256: 0.957 / 1.043 and 32 x 128, kernels of ~0.1 ms, host-noisy); r2 (as the default)
#   128 x 256 x 12 0.853 / 0.853, 32 x 512 0.886 / 0.884, 32 x 1024 0.904 / 0.905, 16 x 1440 0.926 / 0.927,
#   8 x 2048 0.938 / 0.940 (SDPA cuDNN 1.18-1.22x main's time): on for d64 causal, bf16 and fp16, up to 2048
#   queries, as non-causal (longer causal calls unmeasured).
HEURISTIC_WIDE_EPI: frozenset = frozenset({(128, False, "bf16"), (128, False, "fp16"), (128, True, "bf16"),
                                           (256, True, "bf16"), (64, False, "bf16"), (64, False, "fp16"),
                                           (64, True, "bf16"), (64, True, "fp16")})
WIDE_EPI_MAX_SEQLEN_BY: dict = {(64, False, "bf16"): 2048, (64, False, "fp16"): 2048, (64, True, "bf16"): 2048,
                                (64, True, "fp16"): 2048}
# * SOFTCAP_WIDE_EPI, (kernel head dim, causal, dtype): the classes whose softcap calls (softcap alone, MHA,
#   fixed lengths, unordered) take wide_epi too. Measured (session 22, cap9, round 1: tests/softcap_bwd_timing.py,
#   bf16 d128 batch 2 x 16 heads x 8k, softcap 30, x the plain call of the same process, 8 interleaved samples;
#   on an H200; results/NVIDIA_H200/logs/session22_cap9/round1.md), the heuristic -> with wide_epi:
#   causal backward alone 1.152 -> 1.126, forward + backward 1.171 -> 1.158; full 1.137 -> 1.137, 1.150 -> 1.168
#   (not kept). Zero spills in bf16 / fp16, causal / full (nvcc 13.0).
SOFTCAP_WIDE_EPI: frozenset = frozenset({(128, True, "bf16")})
# * SOFTCAP_CAP_FOLD, {(kernel head dim, causal, dtype): form}: the classes whose softcap calls (softcap alone, fixed
#   lengths, unordered) run the folded softcap step (cap_fold, kCapFold, name _cf1 / _cf2 / _cf3): softcap_out in the
#   exponent's FFMA, the thread's words Pᵀ ∘ (1 - tanh²) (16-byte vectors) instead of 1 - tanh²; form 2 also multiplies
#   dPᵀ - D_i by the words in 16 bits (HMUL2), form 3 also takes a quarter of the exp2s off the SFU (exp2_poly). With
#   wide_epi (the d128 dynamic kernel spills without it; the kernel checks MHA and alignment per call). Measured
#   (session 23, cap10, one H100 80GB HBM3: tests/softcap_bwd_timing.py, bf16 d128 batch 2 x 16 heads x 8k, softcap 30,
#   x the plain call of the same process, 10-12 interleaved samples; results/NVIDIA_H100_80GB_HBM3/logs/
#   session23_cap10/), backward alone causal / full:
#     round 3: the heuristic 1.140 / 1.125, form 2 1.129 / 1.115, form 3 1.110 / 1.075 (wide_epi alone, full: 1.130);
#              forward + backward 1.157 / 1.152 -> form 3 1.136 / 1.117; softcap 50 causal: backward 1.108 -> 1.110,
#              forward + backward 1.145 -> 1.133;
#     round 2: the heuristic 1.151 / 1.117, form 2 1.138 / 1.136 (full: its kernel then spilled, without wide_epi),
#              form 2 with 1/8, 1/4 (= form 3), 1/2 of the exp2s moved 1.133 / 1.125, 1.123 / 1.112, 1.140 / 1.122;
#     round 1: form 1 1.159 / 1.170 (slower: not used), form 2 1.128 / 1.144 against 1.124 / 1.136.
#   fp16 keeps the unfolded step (forms 2 and 3 are bf16 only; form 1 was slower), and so do the calls whose heuristic
#   kernel is not the dynamic one (shorter calls: the plain-grid kernels, which compile clean with form 3 but were not
#   measured).
SOFTCAP_CAP_FOLD: dict = {(128, True, "bf16"): 3, (128, False, "bf16"): 3}
DQ_CONVERT_ROWS = 256    # Sm90BwdDqQueue::kRows
DQ_CONVERT_QUEUES = 16   # Sm90BwdDqQueue::kQueues
DQ_TAIL_THREADS = 256    # Sm90BwdDqTail::kThreads
DQ_TAIL_CTAS_PER_SM = 2  # Sm90BwdDqTail::kCtasPerSm
# Whether selection prefers this family's dropout kernels (at head dims 97..128, as rank() does
# for the rest): on since tests/test_sm90_bwd_features_gpu.py's dropout tests passed on an H100
# (off: fa2_bwd runs dropout backwards unless bwd_config= forces this family).
DROPOUT_BY_DEFAULT = True
# The head dims <= 96 at which rank() puts the varlen backward above fa2_bwd (as the dense one: the
# 2-consumer tiles), by kernel head dim: 64 (head dims <= 64, the BM 128 tile) and 96 (65..96, the
# d128 kernel). Before, the varlen backward at d64 was timed only with the one-consumer BM64 BN64
# tile (1.0-1.14x fa2_bwd's time). Measured on the H100 (session 17 round 2, tests/sm90_varlen_timing.py
# --hdims 64 --bwd-only, bf16, 16k tokens, 32 heads): the BM 128 tile's varlen backward in 0.71x /
# 0.71x fa2_bwd's time (mixed lengths 512..8k, full / causal) and 0.86x / 0.91x (short, 64..1k);
# its correctness: tests/test_sm90_varlen_gpu.py (d64 forced). 96 (session 22, fwd14 round 1, an H200, the
# same script --hdims 96 --bwd-only, 21 heads; results/NVIDIA_H200/logs/session22_fwd14/): the d128
# kernel (BM 64) in 0.595 / 0.609x fa2_bwd's time (mixed, full / causal) and 0.725 / 0.776x (short); its
# correctness: tests/test_sm90_varlen_gpu.py test_sm90_varlen_backward_d96_selected. Plain varlen calls
# only (with features: VARLEN_SMALL_D_FEATURES).
VARLEN_SMALL_D: frozenset = frozenset({64, 96})
# The same for varlen calls with features: {kernel head dim: the feature sets (besides varlen) whose varlen
# backward rank() puts above fa2_bwd}; any other set at head dims <= 96 keeps fa2_bwd. Measured (session 22,
# fwd14 round 1, an H200, tests/sm90_varlen_bwd_features_timing.py: bf16 d64, 32 heads, 16k tokens, the
# backward alone, sm90_bwd's heuristic tile x fa2_bwd's time, mixed (512..8k) full / causal, short (64..1k)
# full / causal): window 256 0.664 / 0.795, 0.735 / 0.853; softcap 30 0.817 / 0.789, 0.893 / 0.929; ALiBi
# 0.781 / 0.717, 0.871 / 0.888; dropout 0.1 0.997 / 1.021, 1.039 / 1.106 (not faster: fa2_bwd).
# 96 (head dims 65..96, the d128 kernel; session 25, bwd17 round 1 on the H100, logs/session25_bwd17/r1/, the
# same script at d96, 21 heads, mixed full / causal): window 0.692 / 0.761, softcap 0.647 / 0.648, ALiBi
# 0.625 / 0.618, dropout 0.776 / 0.731 (short, round 4, logs/session25_bwd17/r4/: 0.727 / 0.798, 0.760 / 0.801,
# 0.758 / 0.795, 0.865 / 0.858); the mixes (round 3, logs/session25_bwd17/r3/, mixed full / causal; short, round 4):
# ALiBi + window 0.669 / 0.783, 0.704 / 0.818; ALiBi + softcap 0.636 / 0.625, 0.751 / 0.783; softcap + window
# 0.691 / 0.757, 0.719 / 0.790; ALiBi + softcap + window 0.667 / 0.741, 0.698 / 0.778; dropout + window 0.765 /
# 0.830, 0.792 / 0.858. Within 3% of fa2_bwd somewhere (fa2_bwd kept): ALiBi + dropout 0.951 / 0.948, short 0.998 /
# 1.005; dropout + softcap 0.970 / 0.994; ALiBi + dropout + softcap 0.956 / 0.997.
# The mixes at 64 (session 25, bwd17 round 2 on the H100, logs/session25_bwd17/r2/, d64 as above, mixed full /
# causal; short, round 3): ALiBi + window 0.718 / 0.846, 0.760 / 0.881; ALiBi + softcap 0.792 / 0.819, 0.871 /
# 0.944; softcap + window 0.738 / 0.874, 0.770 / 0.898; ALiBi + softcap + window 0.739 / 0.858, 0.772 / 0.888.
# With dropout not faster (fa2_bwd): + window 0.909 / 0.989, 0.931 / 1.004; + softcap 1.048 / 1.018; + ALiBi
# 0.995 / 0.997; + ALiBi + softcap 1.018 / 0.967; + ALiBi + window 0.902 / 0.999, 0.921 / 1.019; + softcap +
# window 0.881 / 0.984, 0.901 / 1.008; all four 0.869 / 0.990, 0.890 / 1.011 (faster non-causal only).
VARLEN_SMALL_D_FEATURES: dict = {64: frozenset({("window",), ("softcap",), ("alibi",), ("alibi", "window"),
                                                ("alibi", "softcap"), ("softcap", "window"),
                                                ("alibi", "softcap", "window")}),
                                 96: frozenset({("window",), ("softcap",), ("alibi",), ("dropout",),
                                                ("alibi", "window"), ("alibi", "softcap"), ("softcap", "window"),
                                                ("alibi", "softcap", "window"), ("dropout", "window")})}
# Whether a dropout call (dropout alone, head dim 128, non-causal, unordered, fixed lengths) runs the
# plain heuristic's speed flags (DROPOUT_PLAIN_FLAGS: the dynamic scheduler, ds_double, dq_early,
# dk_late, frag_pin with dq_writer), the one set of them that ptxas builds without spills next to the
# keep bits (nvcc 13.0, sm_90a; causal spills 20-32 bytes with every subset tried). Its GPU test
# (tests/test_drop_early_gpu.py) passed on the H100 (session 17 round 1), but it measured no faster:
# backward d128 8k full 7.812 ms against 7.818 (1.61x the plain backward either way). Off.
DROPOUT_PLAIN = False
# Whether dropout calls apply the keep mask to Pᵀ's packed words (drop_packed, kDropPacked, name _dpk;
# kernels_cu/dropout_transposed.cuh): the keep flags as byte signs (no per-element keep bits), a
# permute and two LOP3s per two elements, dV's 1 / (1 - p) in the epilogue; form 2 (_dpk2) also
# stores dS by stmatrix (built without spills with the Philox key opaque per call). The same mask.
# {head dim: form} (dropout alone, fixed lengths, unordered: Sm90BwdConfig.problems); a config's own
# form is kept. Measured (session 21, an H200, tests/sm90_dropout_timing.py, bf16 8k, batch x seqlen
# 16k, 2048 / d heads, p 0.1, x the plain call of the same process, full / causal;
# results/NVIDIA_H200/logs/session21_drp6/): round 1, d128 backward 1.590 / 1.612 -> form 1 1.538 / 1.552, form 2 1.496 /
# 1.498, forward + backward 1.539 / 1.588 -> 1.446 / 1.450 (form 2); ncu (causal): 1241M -> 1045M
# instructions, 4.87 -> 4.41 ms. Round 3, backward, form 0 -> 1 -> 2: d128 1.614 -> 1.546 -> 1.442 /
# 1.650 -> 1.573 -> 1.480, d64 2.140 -> 1.993 -> 1.882 / 2.063 -> 1.917 -> 1.884; forward + backward
# d128 1.572 / 1.572 -> 1.441 / 1.464, d64 1.981 / 1.944 -> 1.788 / 1.798 (form 2). On at d64 and
# d128 (form 2).
DROPOUT_PACKED: dict = {64: 2, 128: 2}
# The dropout backward's speed fields (drop_packed_fast: form 2, head dim 128, BM 64, 2 stages, dq_writer; dropout
# alone, fixed lengths, unordered), by (head dim, dtype, causal): the plain heuristic's (dynamic, ds_double,
# dq_early, dk_late, frag_pin, wide_epi); a missing entry keeps the kernel without them. A config asking for
# drop_packed >= 2 (bwd_config=) keeps its own. Every set of DROPOUT_FAST_SETS builds without spills (nvcc 13.0,
# sm_90a; bf16 and fp16). They were refused as unchecked before (the per-element keep bits spilled with them; the
# byte-sign flags of drop_packed 2 do not). Measured on the H100 (session 27 drp8, tests/drp8_timing.py, bf16 d128
# 8k, 2 x 16 heads, p 0.1, x the plain call of the same process, full / causal; logs/session27_drp8/): round 1,
# the backward alone, drop_packed 2 1.445 / 1.483 -> with all six fields 1.294 / 1.305 (without wide_epi 1.300 /
# 1.335; dynamic alone 1.389 / 1.434; wide_epi alone 1.447 / 1.468; dq_early, dk_late, frag_pin 1.453 / 1.477);
# the timing form without Philox rounds (drop_packed 3) 1.279 / 1.294 -> 1.158 / 1.174 with them. Round 2:
# backward 1.459 / 1.483 -> 1.298 / 1.297, forward + backward 1.474 / 1.475 -> 1.352 / 1.333. On for bf16 (fp16
# not measured).
DROPOUT_FAST_FIELDS = ("dynamic", "ds_double", "dq_early", "dk_late", "frag_pin", "wide_epi")
DROPOUT_FAST: dict = {(128, "bf16", causal): dict(dynamic=True, ds_double=True, dq_early=True, dk_late=True,
                                                  frag_pin=True, wide_epi=True) for causal in (False, True)}
DROPOUT_FAST_SETS = frozenset(frozenset(x) for x in (
    (), ("wide_epi",), ("dynamic",), ("ds_double",), ("dq_early", "dk_late", "frag_pin"),
    ("dynamic", "ds_double", "wide_epi"), ("dynamic", "ds_double", "dq_early", "dk_late", "frag_pin"),
    ("dynamic", "ds_double", "dq_early", "dk_late", "frag_pin", "wide_epi")))
# drop_packed 3: form 2 with the Philox counters for words (no rounds): NOT the dropout mask, a timing form
# that measures what the backward's rounds cost (tests/drp8_timing.py sets this).
DROP_PACKED_TIMING = False
DROPOUT_PLAIN_FLAGS = dict(dq_writer=True, dq_bulk=False, dynamic=True, ds_double=True, dq_early=True,
                           dk_late=True, frag_pin=True)
# Variable-length batches (varlen, kVarlen): whether supports() takes them. On since the GPU
# round of 2026-11-26 (H100, rev 583b8f4): tests/test_sm90_varlen_gpu.py, test_varlen_gpu.py and
# test_varlen_features_gpu.py with it on, and memcheck (tests/sm90_varlen_sanitize.py), passed;
# tests/sm90_varlen_timing.py measured the varlen backward at d128 in 0.58-0.75x fa2_bwd's time
# (d64 1.0-1.14x: rank() keeps fa2_bwd there). Selection then runs the varlen backward here where
# rank() puts this family first; CUFLASH_SM90_VARLEN_BWD=0 turns it off for a process (fa2_bwd).
# Head dims 193..256 / 129..192 (the d256 kernel: BN 64 shared by 2 consumers, dK_j / dV_j split by
# columns; below 256 with zero-filled columns, 192 doing 4/3 of its work): whether rank() puts this
# family above fa2_bwd there. Measured on the H100 (2026-11-26, rev dfc42b8,
# tests/sm90_bwd_d256_timing.py: d256, 8 heads, batch x seqlen 16k, bf16, 4k and 16k, causal and
# not, backward alone): 289-339 TFLOPs, 2.12-2.34x fa2_bwd's speed, 0.79-0.90x SDPA cuDNN's: on.
# 129..192: d192 through the d256 kernel, same script and shape (session 14 round f3,
# results/NVIDIA_H100_80GB_HBM3/sm90_bwd_d256_timing.json: bf16, 2k-16k, causal and not):
# 195-259 TFLOPs, 1.48-1.65x fa2_bwd's speed (its native d192 kernel), 0.72-0.82x cuDNN's: on.
D256_ABOVE_FA2 = True
D192_ABOVE_FA2 = True
VARLEN_BWD = os.environ.get("CUFLASH_SM90_VARLEN_BWD", "1") != "0"
# The feature sets that run with varlen: their varlen instantiations at the heuristic's tiles
# compile without spills (nvcc 13.0, sm_90a; d64 and d128, causal and not, deterministic at d64:
# tests/test_sm90_varlen_cpu.py); any other mix falls back to fa2_bwd. Every subset of window,
# softcap, ALiBi and dropout since session 25 (bwd17): the pairs with ALiBi and the dropout mixes spill
# nothing at d64 and d128, causal and not (deterministic at d64 without dropout); dropout with a window
# and softcap or ALiBi at d128 (8 bytes spilled in some of them) is refused before, by dropout_mix.
VARLEN_FEATURES = ((), ("window",), ("softcap",), ("alibi",), ("dropout",), ("softcap", "window"),
                   ("alibi", "softcap", "window"), ("alibi", "window"), ("alibi", "softcap"),
                   ("dropout", "window"), ("dropout", "softcap"), ("alibi", "dropout"),
                   ("alibi", "dropout", "softcap"), ("alibi", "dropout", "window"),
                   ("dropout", "softcap", "window"), ("alibi", "dropout", "softcap", "window"))
# The feature sets (besides varlen) whose varlen backward rank() puts above fa2_bwd at head dims 97..128
# (the d128 kernel); the others keep fa2_bwd. The sets that ran there before session 25 (the plain varlen
# d128 backward measured 0.58-0.75x fa2_bwd's time, features by the same rule), and the mixes added with
# VARLEN_FEATURES in session 25, each measured faster on the H100 (bwd17 round 1, logs/session25_bwd17/r1/:
# tests/sm90_varlen_bwd_features_timing.py, bf16 d128, 16 heads, 16k tokens of 512..8k, window 256, softcap 30,
# dropout 0.1, the backward alone, x fa2_bwd's time, full / causal): ALiBi + window 0.591 / 0.695, ALiBi +
# softcap 0.531 / 0.518, dropout + window 0.669 / 0.730, dropout + softcap 0.775 / 0.811, ALiBi + dropout
# 0.792 / 0.807, ALiBi + dropout + softcap 0.730 / 0.795.
VARLEN_D128_FEATURES: frozenset = frozenset({
    ("window",), ("softcap",), ("alibi",), ("dropout",), ("softcap", "window"), ("alibi", "softcap", "window"),
    ("alibi", "window"), ("alibi", "softcap"), ("dropout", "window"), ("dropout", "softcap"), ("alibi", "dropout"),
    ("alibi", "dropout", "softcap")})

@dataclasses.dataclass(frozen=True, order=True)
class Sm90BwdConfig(KernelConfig):
    """One sm90_bwd kernel: a CTA owns the K/V block K_j, V_j.

    BM:            queries of each Q block the CTA loops over: 64 or 128
    BN:            keys of the CTA's K/V block: 64 per consumer warpgroup
    stages:        Q/dO ring slots in shared memory (>= 2)
    consumers:     consumer warpgroups (1 or 2); the CTA has 128 · (consumers + 1) threads
    head_dim:      64 or 128 (compile-time; smaller real head dims are zero-filled by TMA)
    dtype:         "bf16" or "fp16"
    causal:        bottom-right aligned causal mask, a compile-time flag
    deterministic: dQ additions in K/V block order (bitwise reproducible, slower)
    window, softcap, alibi: the feature flags (as fa2_bwd's BwdConfig; compile-time)
    dropout:       attention dropout: the forward's keep mask regenerated (compile-time flag)
    dq_bulk:       dQ_i parts added through a shared-memory staging tile by bulk reduce-add
                   (cp.reduce.async.bulk, FA3's way) instead of red.global.add from registers;
                   unordered mode only (not with deterministic); with dropout at head dim 128
                   the dQ path of softcap / ALiBi (dropout_dq_path; for_problem sets it)
    overlap_sdp:   FA3's schedule: dPᵀ issued behind Sᵀ, Pᵀ computed while it runs (both
                   accumulators live); at head dim 128 not with softcap, ALiBi or dropout (those
                   spill; for_problem drops the flag there)
    dq_writer:     FA3's dQ path: the consumers stage dQ_i (BM x head_dim fp32, swizzled) in
                   shared memory, a producer warp adds it by tensor bulk reduce-adds (map tma_dq);
                   2 staging tiles where they fit (dq_writer_bufs); unordered mode only, not with
                   dq_bulk; with dropout at head dim 128 the dQ path without softcap / ALiBi
                   (dropout_dq_path; for_problem sets it)
    varlen:        variable-length batches (kVarlen, kernels_cu/varlen.cuh), set from the call
                   (for_problem), never tuned
    ds_double:     two dS buffers (kDsDouble): Q block q's dS in buffer q % 2, one barrier fewer
                   per Q block between the consumer warpgroups (shared memory permitting)
    lpt:           the launch order (kLpt): K/V block 0 of a group of (head, batch) pairs, then block
                   1, ... (fa2_bwd's order, groups of head_group pairs: two waves of CTAs), so that
                   under the causal mask the longest CTAs start first across pairs and the short ones
                   fill the tail; causal only, not with varlen (the plain order: a pair's K/V
                   blocks in a row)
    cluster:       head dim 256 (shared keys) only: clusters of 2 CTAs on adjacent K/V blocks
                   (sm90_bwd_cluster, kCluster), each loading half of Q_i's and dO_i's chunks by
                   multicast into both (half the L2 reads of the Q/dO stream); the grid's K/V blocks
                   per (head, batch) rounded up to even; not with a window, varlen, deterministic,
                   dynamic or lpt (name _cl2)
    roles:         head dim 256 (shared keys) only: the consumer warpgroups split the products by
                   operand (kRoles): warpgroup 0 Sᵀ, Pᵀ and dV_j (all columns, Pᵀ from registers),
                   warpgroup 1 dPᵀ, dSᵀ and dK_j (Pᵀ handed over in shared memory), both dQ_i by
                   columns; Sᵀ, dPᵀ as m64n64 over all BM queries (fewer shared-memory bytes per Q
                   block than the query split). Plain unordered calls with dq_writer only (name _rol;
                   for_problem drops it for deterministic calls and calls with features). With s_ahead
                   (built, refused: ptxas serializes its wgmmas, C7518; measured slower)
    drop_packed:   dropout's keep mask on Pᵀ's packed 16-bit words (kDropPacked, kernels_cu/
                   dropout_transposed.cuh: byte-sign keep flags, a permute and two LOP3s per two
                   elements, dV's 1 / (1 - p) in the epilogue); 2 also dS stored by stmatrix; the
                   same mask. Dropout alone, fixed lengths, unordered, head dims 64 / 128 (name _dpk,
                   _dpk2). Set by for_problem from DROPOUT_PACKED (a config's own form kept), never
                   tuned
    cap_fold:      softcap's folded step (kCapFold, kernels_cu/sm90_bwd.cu): softcap_out in the exponent's
                   FFMA, the thread's words Pᵀ ∘ (1 - tanh²) (16-byte vectors) instead of 1 - tanh², so
                   that dSᵀ needs no Pᵀ unpacked and no multiply by 1 - tanh²; 2 also multiplies dPᵀ - D_i
                   by the words in 16 bits (HMUL2, dSᵀ rounded twice; bf16 only); 3 as 2 with a quarter of the
                   exp2s on the FMA pipes (exp2_emu.cuh, bf16 only). Softcap without ALiBi or dropout (name
                   _cf1, _cf2, _cf3); the heuristic sets it from SOFTCAP_CAP_FOLD, never tuned
    dq_tail:       the dQ convert as sm90_bwd_dq_tail, launched as a programmatic dependent of the main kernel
                   (kDqTail): its CTAs take the SMs the dynamic scheduler leaves idle at the grid's end and
                   convert the (head, batch) pairs whose K/V tiles are done while the last tiles run; the
                   writer counts each tile once its bulk additions have completed, 1 at the tile's end, 2
                   behind the next tile's first Q block. With dq_writer on the dynamic scheduler, fixed
                   lengths, unordered, not with dq_convert (name _dqt, _dqt2); plain or windowed calls
                   (for_problem drops it for others); the heuristic sets it from WINDOW_DQ_TAIL, never tuned
    """

    BM: int
    BN: int
    stages: int
    consumers: int
    head_dim: int
    dtype: str
    causal: bool
    deterministic: bool = False
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    dropout: bool = False
    dq_bulk: bool = False
    overlap_sdp: bool = False
    dq_writer: bool = False
    varlen: bool = False
    lpt: bool = False
    dynamic: bool = False
    ds_double: bool = False
    cluster: bool = False
    s_ahead: bool = False
    dq_early: bool = False
    q_rotate: bool = False
    dk_late: bool = False
    frag_pin: bool = False
    roles: bool = False
    dq_convert: bool = False
    dq_first: bool = False
    wide_epi: bool = False
    drop_packed: int = 0
    cap_fold: int = 0
    dq_tail: int = 0

    family = "sm90_bwd"
    _what = "sm90 backward"

    @property
    def warps(self) -> int:
        return 4 * (self.consumers + 1)

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        det = "_det" if self.deterministic else ""
        return (f"sm90bwd_{self.dtype}_d{self.head_dim}_{mask}_"
                f"BM{self.BM}_BN{self.BN}_s{self.stages}_c{self.consumers}{det}{'_drop' if self.dropout else ''}{name_suffix(self)}"
                f"{'_dqb' if self.dq_bulk else ''}{'_ovl' if self.overlap_sdp else ''}"
                f"{'_dqw' if self.dq_writer else ''}{'_varlen' if self.varlen else ''}"
                f"{'_lpt' if self.lpt else ''}{'_dyn' if self.dynamic else ''}"
                f"{'_ds2' if self.ds_double else ''}{'_cl2' if self.cluster else ''}{'_sah' if self.s_ahead else ''}"
                f"{'_dqe' if self.dq_early else ''}{'_rot' if self.q_rotate else ''}"
                f"{'_dkl' if self.dk_late else ''}{'_pin' if self.frag_pin else ''}{'_rol' if self.roles else ''}"
                f"{'_dqc' if self.dq_convert else ''}{'_dqf' if self.dq_first else ''}{'_w16' if self.wide_epi else ''}"
                f"{'_dpk' if self.drop_packed == 1 else f'_dpk{self.drop_packed}' if self.drop_packed else ''}"
                f"{f'_cf{self.cap_fold}' if self.cap_fold else ''}"
                f"{'_dqt' if self.dq_tail == 1 else f'_dqt{self.dq_tail}' if self.dq_tail else ''}")

    @property
    def shared_keys(self) -> bool:
        """The head-dim-256 tile (kSharedKeys): BN 64 with 2 consumers, both warpgroups on the same
        64 keys; each computes Sᵀ, dPᵀ for BM / 2 queries and dK_j, dV_j for head_dim / 2 columns
        (64 keys x 256 fp32 of each do not fit one warpgroup's registers); Pᵀ and dSᵀ go through
        shared memory as the A operands of dV, dK (SS)."""
        return self.BN == 64 and self.consumers == 2

    @property
    def s_cols(self) -> int:
        """Queries of a warpgroup's Sᵀ, dPᵀ (kSN): BM, or BM / 2 with shared keys."""
        return self.BM // 2 if self.shared_keys else self.BM

    @property
    def dkv_cols(self) -> int:
        """Columns of dK_j, dV_j per warpgroup (kDkvN): head_dim, or head_dim / 2 with shared keys."""
        return self.head_dim // 2 if self.shared_keys else self.head_dim

    @property
    def dq_cols(self) -> int:
        """Head-dim columns of dQ_i per consumer warpgroup (kDqN): the BM x head_dim tile is
        split into BM / 64 row groups x (consumers / (BM / 64)) column groups: 64 or 128, or 32
        at head dim 64 with BM 64 and 2 consumers (wgmma m64n32k16, K_j's operand starting
        halfway into its 128-byte swizzled rows)."""
        row_groups = max(self.BM // 64, 1)
        col_groups = max(self.consumers // row_groups, 1)
        return self.head_dim // col_groups

    @property
    def smem_bytes(self) -> int:
        """K_j, V_j; stages x (Q_i, dO_i, LSE_i, D_i); dS; the mbarriers (kv_full, q_full and
        q_empty per slot); 1024 bytes to align the base (as Sm90BwdShape::kSmemBytes). Softcap and
        dropout add, 16-byte aligned, each consumer thread's words: BM / 2 16-bit values each
        (1 - tanh², the signed Pᵀ: Sm90BwdThreadWords in sm90_bwd.cu)."""
        tiles = 2 * self.BN * self.head_dim * 2 + 2 * self.stages * self.BM * self.head_dim * 2
        # shared keys: dS, Pᵀ, dSᵀ; ds_double: 2 dS buffers
        ds_tiles = 3 if self.shared_keys else 1 + int(self.ds_double)
        used = (tiles + ds_tiles * self.BM * self.BN * 2 + 2 * self.stages * self.BM * 4
                + 8 * (1 + 2 * self.stages))
        if self.dynamic:   # kv_empty, dq_writer's 2 mbarriers, the tile ring's 4, its 2 slots (2 ints each) and count
            used += 8 * 7 + 24
        # (shared keys: the words stay in registers)
        words = 0 if self.shared_keys else (int(self.softcap) + int(self.dropout)) * self.BM // 4
        if words:
            used = -(-used // 16) * 16 + words * 4 * self.consumers * 128
        if self.dq_bulk:
            used = -(-used // 16) * 16 + self.dq_stage_bytes
        if self.dq_writer and not self.shared_keys:   # (shared keys: staged in the Q/dO ring slot)
            used = -(-used // 1024) * 1024 + self.dq_writer_bufs * self.BM * self.head_dim * 4
        return used + 1024

    def dropout_dq_path(self):
        """The dQ path of a head dim 128 dropout kernel (unordered mode), the one that ptxas
        (nvcc 13.0, sm_90a) builds without spills since the 32-key Philox layout (four calls per
        thread and Q block: philox.cuh's keep_bits_transposed): "dq_writer" without softcap and
        ALiBi (a window too), "dq_bulk" with softcap and / or ALiBi; None for a window with
        either (every path spills 4-12 bytes). The consumers' red.add spills 8-36 bytes with
        dropout at d128 in every mix. tests/test_sm90_bwd_cpu.py holds it to ptxas."""
        if self.window and (self.softcap or self.alibi):
            return None
        return "dq_bulk" if self.softcap or self.alibi else "dq_writer"

    @property
    def dq_writer_bufs(self) -> int:
        """dq_writer's staging tiles of BM x head_dim fp32 (Sm90BwdDqWriterStage::kBufs), past the
        rest, 1024-byte aligned: 2 (the consumers fill one while the bulk op reads the other)
        where they fit in 227 KB, else 1; 0 without dq_writer, and with shared keys (head dim 256:
        dQ_i's part is staged in the ring slot that held Q_i, dO_i, Sm90BwdSlotDqStage)."""
        if not self.dq_writer or self.shared_keys:
            return 0
        offset = -(-(self.replace(dq_writer=False).smem_bytes - 1024) // 1024) * 1024
        return 2 if offset + 2 * self.BM * self.head_dim * 4 + 1024 <= MAX_SMEM else 1

    @property
    def dq_stage_bytes(self) -> int:
        """dq_bulk's staging tile (Sm90BwdDqStage): per consumer warpgroup 64 rows x
        (dq_cols + 8) fp32, the 8 words padding each row against bank conflicts."""
        return self.consumers * 64 * (self.dq_cols + 8) * 4 if self.dq_bulk else 0

    @property
    def shape(self) -> tuple:
        """(BM, BN, consumers, head_dim): the tile, as PTXAS_FITS lists them."""
        return (self.BM, self.BN, self.consumers, self.head_dim)

    @property
    def accum_regs(self) -> int:
        """32-bit registers per consumer thread: dK, dV (dkv_cols / 2 each), Sᵀ and dPᵀ (s_cols / 2
        each), the 16-bit fragments of Pᵀ and dSᵀ (s_cols / 4 each), the dQ part (dq_cols / 2)."""
        return self.dkv_cols + self.s_cols + self.s_cols // 2 + self.dq_cols // 2

    def bm80_refused(self) -> bool:
        """Whether BM 80 (kDqSwap: FA3's non-causal d128 tile, dQ_iᵀ = K_jᵀ dSᵀ by m64n80k16 with A
        transposed, staged transposed for dq_writer) is unbuilt for this config: it is built for head
        dim 128, 2 consumers, dq_writer, non-causal, fixed lengths, unordered, no feature, the plain grid
        (static_assert in sm90_bwd.cu); bf16 only: ptxas (nvcc 13.0) spills the fp16 kernel (40 bytes,
        with or without dq_early / dk_late / ds_double / frag_pin), and the bf16 one with frag_pin (36)."""
        return (self.dtype != "bf16" or self.frag_pin or self.head_dim != 128 or self.consumers != 2 or self.BN != 128 or not self.dq_writer
                or self.causal or self.window or self.varlen or self.deterministic or self.dynamic
                or self.softcap or self.alibi or self.dropout or self.dq_bulk or self.overlap_sdp
                or self.s_ahead or self.q_rotate or self.lpt or self.cluster)

    def overlap_sdp_spills(self) -> bool:
        """Whether overlap_sdp's kernel spills at head dim 128 (nvcc 13.0, sm_90a, BM 64): with
        softcap, ALiBi or dropout; plain, causal and window kernels fit
        (tests/test_sm90_bwd_sched_cpu.py holds it)."""
        return self.softcap or self.alibi or self.dropout

    def overlap_sdp_refused(self) -> bool:
        """Whether overlap_sdp's kernel spills for this config (nvcc 13.0, sm_90a): at head dim 128
        with softcap, ALiBi or dropout (overlap_sdp_spills); at head dim 256 with dropout (causal
        spills 8 bytes; tests/test_sm90_bwd_d256_cpu.py holds the rest to zero)."""
        return (self.head_dim == 128 and self.overlap_sdp_spills()) or (self.shared_keys and self.dropout)
    def dynamic_spills(self) -> bool:
        """Whether the dynamic scheduler's kernel spills (nvcc 13.0, sm_90a): without dq_writer (the
        consumers' red.add or dq_bulk paths), at stages > 2, with dropout (d128; d64's BM 128 tile
        has no dropout anyway). tests/test_sm90_bwd_causal_cpu.py holds the allowed ones to zero
        spills."""
        return (not self.dq_writer or self.stages > 2
                or (self.dropout and not (self.dropout_plain() or self.drop_packed_fast()))
                or self.feature_sched_spills())

    def feature_sched_spills(self) -> bool:
        """Whether a window / softcap / ALiBi kernel with dk_late spills on the dynamic scheduler (nvcc 13.0,
        sm_90a; 8-12 bytes of stores): in fp16 (window, softcap causal, ALiBi), in bf16 ALiBi causal and a
        window without ds_double; the plain grid's spill in neither dtype (tests/test_bwd_feature_sched_cpu.py)."""
        return (self.dynamic and self.dk_late and (self.window or self.softcap or self.alibi)
                and (self.dtype == "fp16" or (self.alibi and self.causal) or (self.window and not self.ds_double)))

    def dropout_plain(self) -> bool:
        """Whether this is the dropout kernel with the plain heuristic's speed flags that ptxas builds
        without spills (DROPOUT_PLAIN_FLAGS; dropout alone, head dim 128, non-causal, BM 64, 2 stages,
        unordered, fixed lengths). tests/test_drop_early_cpu.py holds it to ptxas."""
        return (self.dropout and self.head_dim == 128 and not self.causal and self.BM == 64 and self.stages == 2
                and not (self.window or self.softcap or self.alibi or self.varlen or self.deterministic
                         or self.overlap_sdp or self.s_ahead or self.q_rotate or self.lpt or self.roles)
                and all(getattr(self, k) == v for k, v in DROPOUT_PLAIN_FLAGS.items()))

    def fast_fields(self) -> frozenset:
        """The plain call's speed fields (DROPOUT_FAST_FIELDS) this config sets."""
        return frozenset(k for k in DROPOUT_FAST_FIELDS if getattr(self, k))

    def drop_packed_fast(self) -> bool:
        """Whether this is a drop_packed (form 2) dropout kernel, head dim 128, BM 64, 2 stages, dq_writer
        (dropout alone, fixed lengths, unordered): the tile on which the plain heuristic's speed fields
        (dynamic, ds_double, dq_early, dk_late, frag_pin) and wide_epi build without spills next to the
        byte-sign keep flags (nvcc 13.0, sm_90a; causal and not, bf16 and fp16), in the sets
        DROPOUT_FAST_SETS lists (the ones checked: tests/test_drp8_cpu.py holds them to ptxas)."""
        return (self.dropout and self.drop_packed in (2, 3) and self.head_dim == 128 and self.BM == 64
                and self.stages == 2 and self.dq_writer and not self.dq_bulk
                and self.fast_fields() in DROPOUT_FAST_SETS
                and not (self.window or self.softcap or self.alibi or self.varlen or self.deterministic
                         or self.overlap_sdp or self.s_ahead or self.q_rotate or self.lpt or self.roles
                         or self.shared_keys))

    def feature_sched_built(self) -> bool:
        """Whether this is a window / softcap / ALiBi kernel whose feature set FEATURE_SCHED_BUILT lists
        at its head dim, on the tile that builds the plain schedule fields with them (BM 64, 2
        consumers, dq_writer; fixed lengths, unordered, no dropout); with softcap or ALiBi only with
        ds_double, dq_early, dk_late and frag_pin all on (the combination whose kernels are checked)."""
        feats = tuple(f for f in ("alibi", "softcap", "window") if getattr(self, f))
        # (softcap / ALiBi: the plain call's four main-loop fields together, the combination checked; a
        # window took any of them before)
        whole = self.ds_double and self.dq_early and self.dk_late and self.frag_pin
        return (bool(feats) and feats in FEATURE_SCHED_BUILT.get(self.head_dim, ()) and self.BM == 64
                and self.consumers == 2 and self.dq_writer and (whole or feats == ("window",))
                and not (self.dropout or self.varlen or self.deterministic or self.shared_keys))

    def bm128_spills(self) -> bool:
        """Whether the BM 128 tile (head dim 64, PTXAS_FITS) spills (nvcc 13.0, sm_90a): with
        softcap or ALiBi, and with overlap_sdp next to a window, at stages > 2 or without
        dq_writer (fp16 causal spills) (tests/test_sm90_bwd_d64_cpu.py holds the allowed ones to
        zero spills); with dropout it does not compile (a thread's keep bits of Pᵀ are one 32-bit
        word)."""
        return (self.softcap or self.alibi or self.dropout
                or (self.overlap_sdp and (self.window or self.stages > 2 or not self.dq_writer)))

    def kernel_name(self) -> str:
        b = lambda x: "true" if x else "false"  # noqa: E731
        if self.cluster:   # sm90_bwd_cluster: its cluster size, then every argument of sm90_bwd
            return (f"cuflash::sm90_bwd_cluster<2, {self.BM}, {self.BN}, {self.stages}, {self.consumers}, "
                    f"{self.head_dim}, cuflash::{self.dtype}, "
                    + ", ".join(b(getattr(self, f)) for f in (
                        "causal", "deterministic", "window", "softcap", "alibi", "dropout", "dq_bulk",
                        "overlap_sdp", "dq_writer", "varlen", "lpt", "dynamic", "ds_double"))
                    + (f", {b(self.roles)}, {b(self.s_ahead)}" if self.roles or self.s_ahead else "") + ">")
        # the feature flags only when one is set: a plain config keeps its name expression
        tail = (self.s_ahead or self.dq_early or self.q_rotate or self.dk_late or self.frag_pin or self.roles
                or self.dq_convert or self.dq_first or self.wide_epi or self.drop_packed or self.cap_fold
                or self.dq_tail)
        sched = (self.overlap_sdp or self.dq_writer or self.varlen or self.lpt or self.dynamic or self.ds_double
                 or tail)
        feats = (template_suffix(self) if any(getattr(self, f) for f in KERNEL_FLAGS) or self.dropout
                 or self.dq_bulk or sched else "")
        feats += f", {b(self.dropout)}" if self.dropout or self.dq_bulk or sched else ""
        feats += f", {b(self.dq_bulk)}" if self.dq_bulk or sched else ""
        feats += f", {b(self.overlap_sdp)}, {b(self.dq_writer)}" if sched else ""
        later = self.lpt or self.dynamic or self.ds_double or tail
        feats += f", {b(self.varlen)}" if self.varlen or later else ""                        # kVarlen
        feats += f", {b(self.lpt)}" if later else ""                                          # kLpt
        feats += f", {b(self.dynamic)}" if self.dynamic or self.ds_double or tail else ""    # kDynamic
        feats += f", {b(self.ds_double)}" if self.ds_double or tail else ""                  # kDsDouble
        feats += f", {b(self.s_ahead)}, {b(self.dq_early)}" if tail else ""                  # kSAhead, kDqEarly
        last = self.drop_packed or self.cap_fold or self.dq_tail
        later2 = (self.dk_late or self.frag_pin or self.roles or self.dq_convert or self.dq_first or self.wide_epi
                  or last)
        later3 = self.roles or self.dq_convert or self.dq_first or self.wide_epi or last
        feats += f", {b(self.q_rotate)}" if self.q_rotate or later2 else ""                   # kQRotate
        feats += f", {b(self.dk_late)}" if later2 else ""                                     # kDkLate
        feats += f", {b(self.frag_pin)}" if self.frag_pin or later3 else ""                  # kFragPin
        feats += f", {b(self.roles)}" if later3 else ""                                       # kRoles
        feats += (f", {b(self.dq_convert)}" if self.dq_convert or self.dq_first or self.wide_epi or last
                  else "")                                                                    # kDqConvert
        feats += f", {b(self.dq_first)}" if self.dq_first or self.wide_epi or last else ""   # kDqFirst
        feats += f", {b(self.wide_epi)}" if self.wide_epi or last else ""                     # kWideEpi
        feats += f", {int(self.drop_packed)}" if last else ""                                 # kDropPacked
        feats += f", {int(self.cap_fold)}" if self.cap_fold or self.dq_tail else ""           # kCapFold
        feats += f", {int(self.dq_tail)}" if self.dq_tail else ""                             # kDqTail last
        return (f"cuflash::sm90_bwd<{self.BM}, {self.BN}, {self.stages}, {self.consumers}, "
                f"{self.head_dim}, cuflash::{self.dtype}, {b(self.causal)}, {b(self.deterministic)}{feats}>")

    def template_args(self) -> tuple:
        if self.cluster:   # (sm90_bwd_cluster's leading cluster size; none of the main-loop flags after
            return ((2,) + self.replace(cluster=False).template_args()[:19]   # kDsDouble: d256 has none)
                    + (self.roles, self.s_ahead))                                 # (then kRoles, kSAhead)
        return (self.BM, self.BN, self.stages, self.consumers, self.head_dim, self.dtype,
                self.causal, self.deterministic, self.window, self.softcap, self.alibi, self.dropout,
                self.dq_bulk, self.overlap_sdp, self.dq_writer, self.varlen, self.lpt, self.dynamic,
                self.ds_double, self.s_ahead, self.dq_early, self.q_rotate, self.dk_late, self.frag_pin,
                self.roles, self.dq_convert, self.dq_first, self.wide_epi, int(self.drop_packed), int(self.cap_fold),
                int(self.dq_tail))

    def _problems(self) -> list[str]:
        out = []
        if self.head_dim not in HEAD_DIMS:
            out.append(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if self.consumers not in (1, 2):
            out.append(f"consumers must be 1 or 2, got {self.consumers}")
        elif self.head_dim == 256 and not self.shared_keys:
            out.append(f"head_dim=256 takes BN=64 with consumers=2 (the warpgroups share the keys and "
                       f"split dK_j, dV_j by columns: 64 x 256 fp32 of each exceed one warpgroup's "
                       f"registers), got BN={self.BN}, consumers={self.consumers}")
        elif self.shared_keys and self.head_dim != 256:
            out.append(f"BN=64 with consumers=2 (shared keys) is the head_dim=256 tile, got "
                       f"head_dim={self.head_dim}")
        elif self.BN != 64 * self.consumers and not self.shared_keys:
            out.append(f"BN={self.BN} must be 64 * consumers = {64 * self.consumers} "
                       "(each consumer warpgroup owns 64 keys)")
        if self.BM == 80 and self.bm80_refused():
            out.append(f"BM=80 (the swapped dQ GEMM) is built for bf16, head_dim=128, 2 consumers, dq_writer, "
                       f"non-causal fixed-length unordered calls without features, the plain grid, not with "
                       f"dq_bulk / overlap_sdp / s_ahead / q_rotate / lpt / cluster / frag_pin (ptxas spills "
                       f"fp16 and frag_pin; {self.name})")
        elif self.BM not in (64, 80, 128):
            out.append(f"BM must be 64 or 128 (the wgmma N of S and dP), or 80 at head dim 128, got {self.BM}")
        elif self.shared_keys and self.BM != 64:
            out.append(f"BN=64 with consumers=2 (shared keys) takes BM=64 (32 queries of Sᵀ per "
                       f"warpgroup), got BM={self.BM}")
        elif self.consumers in (1, 2) and (self.BM // 64 > self.consumers or self.consumers % (self.BM // 64)):
            out.append(f"BM={self.BM}: BM / 64 must divide consumers={self.consumers} "
                       "(each warpgroup computes 64 rows of dQ_i)")
        elif self.head_dim in HEAD_DIMS and self.consumers in (1, 2) and self.dq_cols % 64 and self.dq_cols != 32:
            out.append(f"BM={self.BM}, consumers={self.consumers}: each warpgroup's dQ columns "
                       f"({self.dq_cols}) must be whole 64-column chunks or 32 (half of one)")
        if self.stages < 2:
            out.append(f"stages must be >= 2, got {self.stages}")
        if self.dq_bulk and self.deterministic:
            out.append("dq_bulk with deterministic: the ordered dQ additions keep red.add "
                       "(dq_bulk is the unordered mode's)")
        if self.dq_writer and self.deterministic:
            out.append("dq_writer with deterministic: the ordered dQ additions keep red.add "
                       "(dq_writer is the unordered mode's)")
        if self.dq_writer and self.dq_bulk:
            out.append("dq_writer with dq_bulk: two ways of the same dQ addition, pick one")
        if self.lpt and self.varlen:
            out.append("lpt with varlen: a varlen grid keeps the plain order (its K/V blocks past a "
                       "sequence's end leave at once)")
        if self.dynamic and (self.varlen or self.deterministic):
            out.append("dynamic with varlen or deterministic: the dynamic scheduler runs fixed-length "
                       "unordered backwards (its claims do not follow a varlen grid's empty K/V blocks, "
                       "nor the ordered additions' turns)")
        if self.cluster and (not self.shared_keys or self.window or self.varlen or self.deterministic
                             or self.dynamic or self.lpt):
            out.append("cluster: the head_dim=256 tile only, without a window, varlen, deterministic, dynamic "
                       "or lpt (both CTAs of a cluster walk the same Q blocks, in the plain grid)")
        if self.dynamic and self.shared_keys and not self.roles:
            out.append(f"dynamic at head_dim={self.head_dim} (the shared-keys tile) without roles: that kernel runs "
                       "one CTA per K/V block only (the dynamic scheduler is built with roles there)")
        if not out and self.dynamic and self.dynamic_spills():
            out.append("dynamic without dq_writer, at stages > 2, with dropout, or with dk_late next to a window / "
                       "softcap / ALiBi in fp16 (bf16: ALiBi causal, a window without ds_double): ptxas spills that "
                       "kernel (nvcc 13.0)")
        if self.ds_double and (self.head_dim != 128 or ((self.softcap or self.alibi) and not self.feature_sched_built())
                               or (self.dropout and not (self.dropout_plain() or self.drop_packed_fast()))):
            out.append("ds_double at head dim 64 (ptxas spills its dynamic kernel; dq_writer loses its "
                       "second staging tile) or with softcap / ALiBi / dropout (unchecked): head dim 128 "
                       "without them only")
        # (roles has its own s_ahead: the next Q block's Sᵀ / dPᵀ behind the last dQ GEMM; built,
        # refused: ptxas serializes its wgmmas, C7518, and it measured 0.81-0.90x cuDNN against roles'
        # 0.95-1.11x)
        if self.s_ahead and self.roles:
            out.append("s_ahead with roles: ptxas serializes that kernel's wgmmas (C7518: a wgmma in a "
                       "divergent path; nvcc 13.0), measured slower than roles alone")
        elif ((self.dq_early and (self.shared_keys or self.overlap_sdp))
                or (self.s_ahead and not self.roles and (self.shared_keys or self.overlap_sdp))):
            what = "dq_early" if self.dq_early and (self.shared_keys or self.overlap_sdp) else "s_ahead"
            out.append(f"{what} with the shared-keys tile (head_dim=256; "
                       "s_ahead: without roles) or overlap_sdp: built for the head dim 64 / 128 tiles' order of "
                       "GEMMs only")
        elif (self.s_ahead or (self.dq_early and not self.feature_sched_built())) and (
                self.softcap or self.alibi
                or (self.dropout and not (self.dropout_plain() or (self.drop_packed_fast() and not self.s_ahead)))):
            out.append(f"{'s_ahead' if self.s_ahead else 'dq_early'} with softcap / ALiBi / dropout: "
                       "unchecked (more accumulators live; those kernels are near the register budget)")
        elif self.s_ahead and not self.roles and (self.dq_early or self.q_rotate or not self.dq_writer
                                                  or self.head_dim != 128 or self.dtype != "bf16"):
            out.append("s_ahead with dq_early or q_rotate, without dq_writer, at head dim 64 or in fp16: ptxas "
                       "spills those kernels (4-24 bytes, nvcc 13.0); bf16 head dim 128 with dq_writer only")
        elif self.s_ahead:
            # (the rest: bf16 head dim 128 with dq_writer; outside the tuning space too)
            out.append("s_ahead: ptxas serializes the wgmmas of every kernel it builds (C7515, nvcc 13.0; "
                       "bf16 head dim 128 with dq_writer, plain grid or dynamic, ds_double or not), and it "
                       "measured 13-20% slower (HEURISTIC_S_AHEAD)")
        if self.dk_late and not (self.dq_early and self.dq_writer and not self.s_ahead):
            out.append("dk_late without dq_early and dq_writer, or with s_ahead: its dK GEMM is issued behind "
                       "dq_early's dQ GEMM and waited for after dq_writer's staging")
        elif self.dk_late and self.dynamic and self.head_dim == 128 and not self.frag_pin:
            out.append("dk_late with dynamic at head_dim=128 without frag_pin: ptxas spills that kernel (8-32 "
                       "bytes, nvcc 13.0; with frag_pin it fits)")
        if self.frag_pin and (self.shared_keys or ((self.softcap or self.alibi) and not self.feature_sched_built())
                              or (self.dropout and not (self.dropout_plain() or self.drop_packed_fast()))):
            out.append("frag_pin with the shared-keys tile (head_dim=256: its dV GEMM is SS) or with softcap / "
                       "ALiBi / dropout (unchecked): built for the head dim 64 / 128 tiles' RS dV GEMM")
        if self.q_rotate and (self.causal or self.window or self.deterministic or self.shared_keys):
            out.append("q_rotate with causal, a window, deterministic or the shared-keys tile (head_dim=256): "
                       "it rotates the unmasked, unordered Q-block loop of the head dim 64 / 128 tiles only")
        elif self.q_rotate and (self.softcap or self.alibi or self.dropout):
            out.append("q_rotate with softcap / ALiBi / dropout: unchecked (one more register across the "
                       "loop in kernels near the register budget)")
        elif self.q_rotate and self.dk_late and self.dynamic and self.head_dim == 128 and self.dtype == "fp16":
            out.append("q_rotate with dk_late on the dynamic scheduler at head_dim=128 in fp16: ptxas spills that "
                       "kernel (4 bytes of stores, 16 of loads, nvcc 13.0; ds_double or not)")
        if self.roles and (not self.shared_keys or not self.dq_writer or self.deterministic or self.window
                           or self.softcap or self.alibi or self.dropout or self.varlen or self.overlap_sdp):
            out.append("roles: the head_dim=256 tile's plain unordered backward with dq_writer only (no "
                       "deterministic, window, softcap, ALiBi, dropout, varlen or overlap_sdp; with "
                       "red.add ptxas spills it, nvcc 13.0)")
        if self.dq_convert and (not self.dq_writer or self.deterministic or self.varlen or self.cluster
                                or self.softcap or self.alibi or self.dropout
                                or self.head_dim == 64 or (self.head_dim == 128 and not self.dynamic)
                                or (self.shared_keys and not self.roles)):
            out.append("dq_convert: the dQ convert inside the main kernel, with dq_writer, for plain or windowed "
                       "fixed-length unordered calls (no deterministic, varlen, softcap, ALiBi, dropout, cluster) of "
                       "the head dim 128 tile with the dynamic scheduler or the head_dim=256 tile with roles "
                       "(at head dim 64 ptxas spills the bf16 non-causal kernel, 8 bytes, nvcc 13.0)")
        if self.dq_tail not in (0, 1, 2) or (self.dq_tail and (
                not self.dq_writer or not self.dynamic or self.dq_convert or self.deterministic or self.varlen
                or self.cluster)):
            # (the in-kernel convert's name is not in this message: for_problem keeps that one and drops dq_tail)
            out.append("dq_tail (0, 1 or 2): the dQ convert as a programmatic dependent of the main kernel, with "
                       "dq_writer on the dynamic scheduler, for fixed-length unordered calls (no deterministic, varlen "
                       "or cluster; not with the convert inside the main kernel)")
        if self.dq_first and (not self.dq_writer or self.deterministic or self.varlen or self.cluster
                              or self.BM % 64):
            out.append("dq_first: the dQ accumulator zeroed in the main kernel (no zeroing preprocess), with "
                       "dq_writer, for fixed-length unordered calls (no deterministic, varlen or cluster), BM 64 "
                       "or 128")
        if self.wide_epi and (self.deterministic or self.varlen or self.cluster or self.alibi
                              or (self.dropout and not self.drop_packed_fast())):
            out.append("wide_epi: the 16-byte dK / dV epilogue stores, for plain, windowed or softcapped fixed-length "
                       "unordered calls, or dropout on the drop_packed_fast tile (no deterministic, varlen, cluster, "
                       "ALiBi: the d128 ALiBi kernel spilled 8 bytes with them, session 19)")
        if self.drop_packed not in (0, 1, 2) and not (self.drop_packed == 3 and DROP_PACKED_TIMING):
            out.append(f"drop_packed must be 0, 1 or 2, got {self.drop_packed} (3: a timing form, not the mask: "
                       "DROP_PACKED_TIMING)")
        elif self.drop_packed and not (self.dropout and not (self.window or self.softcap or self.alibi)
                                       and not self.deterministic and not self.varlen and not self.cluster
                                       and self.head_dim in (64, 128) and not self.shared_keys
                                       and (self.drop_packed_fast()
                                            or not (self.dynamic or self.ds_double or self.dq_early or self.dk_late
                                                    or self.frag_pin or self.wide_epi))
                                       and not (self.s_ahead or self.overlap_sdp)):
            out.append("drop_packed: the keep mask on Pᵀ's packed words (kDropPacked, kernels_cu/"
                       "dropout_transposed.cuh), for dropout alone (no window, softcap, ALiBi), fixed lengths, "
                       "unordered, head dims 64 / 128; the plain call's speed fields (dynamic, ds_double, dq_early, "
                       "dk_late, frag_pin, wide_epi) only on the drop_packed_fast tile (form 2, head dim 128, BM 64, "
                       "2 stages, dq_writer); never s_ahead or overlap_sdp (the kernels checked for spills)")
        if self.cap_fold not in (0, 1, 2, 3):
            out.append(f"cap_fold must be 0, 1, 2 or 3, got {self.cap_fold}")
        elif self.cap_fold and not (self.softcap and not self.alibi and not self.dropout and not self.cluster):
            out.append("cap_fold: softcap's folded step (kCapFold: the word Pᵀ ∘ (1 - tanh²)), for softcap without "
                       "ALiBi or dropout, no cluster")
        elif self.cap_fold and self.head_dim == 128 and self.dynamic and not self.wide_epi:
            out.append("cap_fold on the head-dim-128 dynamic kernel without wide_epi: ptxas spills it (8-32 bytes, "
                       "nvcc 13.0; with the 16-byte epilogue it does not)")
        elif self.cap_fold >= 2 and self.dtype != "bf16":
            out.append("cap_fold 2 / 3 round dPᵀ - D_i to the input dtype before the multiply: bf16 only (fp16's "
                       "range, 65504, could overflow where dSᵀ itself does not; 3's software exp2 is bf16's degree)")
        if self.lpt and not self.causal:
            out.append("lpt without causal: every CTA has the same work, nothing to order (and ptxas "
                       "spills the d128 kernel; nvcc 13.0)")
        if not out and self.smem_bytes > MAX_SMEM:
            out.append(f"needs {self.smem_bytes} bytes of shared memory, more than the "
                       f"{MAX_SMEM} an sm_90 CTA can have")
        if not out and self.overlap_sdp and self.overlap_sdp_refused():
            what = "dropout" if self.shared_keys else "softcap / ALiBi / dropout"
            out.append(f"overlap_sdp at head_dim={self.head_dim} with {what}: "
                       "ptxas spills that kernel (Sᵀ and dPᵀ live together; nvcc 13.0)")
        if not out and self.dropout and self.head_dim == 128 and not self.deterministic:
            path = self.dropout_dq_path()
            if path is None:
                out.append(f"dropout with a window and softcap / ALiBi at head_dim={self.head_dim}: "
                           "ptxas spills that kernel with every dQ path (nvcc 13.0); fa2_bwd runs it")
            elif (self.dq_writer, self.dq_bulk) != (path == "dq_writer", path == "dq_bulk"):
                out.append(f"dropout at head_dim={self.head_dim} takes {path} with these features: "
                           "ptxas spills the other dQ paths (nvcc 13.0; dropout_dq_path)")
        if not out and self.dq_bulk and self.dropout and self.consumers > 1 and self.head_dim == 64:
            out.append(f"dq_bulk with dropout and {self.consumers} consumers (head_dim={self.head_dim}): "
                       "ptxas spills that kernel under the 240-register budget (nvcc 13.0); the red.add "
                       "one (dq_bulk=False) runs it")
        if not out and self.dropout and self.BM > 64:
            out.append(f"dropout with BM={self.BM}: the kernel keeps a thread's keep bits of Pᵀ "
                       "(BM / 2) in one 32-bit word; BM=64 runs it")
        if not out and self.BM > 64 and self.bm128_spills():
            out.append(f"BM={self.BM} with softcap / ALiBi, or overlap_sdp with a window, stages > 2 "
                       "or without dq_writer: ptxas spills that kernel (nvcc 13.0); BM=64 runs it")
        if not out and self.dropout and self.shared_keys and (self.window or self.softcap or self.alibi):
            out.append(f"dropout with a window, softcap or ALiBi at head_dim={self.head_dim}: ptxas "
                       "spills those kernels (causal; a window: all) (nvcc 13.0); fa2_bwd runs them")
        if not out and self.dropout and self.deterministic and self.head_dim == 128:
            out.append(f"dropout with deterministic at head_dim={self.head_dim}: ptxas spills "
                       "that kernel (nvcc 13.0); fa2_bwd runs it")
        if not out and self.accum_regs > MAX_ACCUM_REGS and self.shape not in PTXAS_FITS:
            out.append(f"{self.accum_regs} registers of accumulators and fragments per consumer "
                       f"thread (dK, dV, S, dP, P, dS, dQ) exceed the budget of {MAX_ACCUM_REGS}: "
                       "it would spill")
        return out


def with_cap_fold(config, problem: Problem, max_smem: Optional[int] = None):
    """The heuristic's config with SOFTCAP_CAP_FOLD's form where it was measured: softcap alone, fixed lengths,
    unordered, on the dynamic kernel (8k), with wide_epi where the kernel needs it (the d128 dynamic one spills
    without; it checks MHA and alignment per call, 4-byte stores otherwise). With the softcap flag set, as
    for_problem sets it: cap_fold is built for softcap only."""
    form = SOFTCAP_CAP_FOLD.get((config.head_dim, config.causal, config.dtype), 0)
    if (not form or tuple(problem.features) != ("softcap",) or problem.deterministic or is_varlen(problem)
            or not config.dynamic):
        return config
    fold = config.replace(softcap=True, cap_fold=form)
    if fold.problems(max_smem):
        fold = fold.replace(wide_epi=True)
    return config if fold.problems(max_smem) else fold


def with_drop_packed(config):
    """config with drop_packed as for_problem sets it: on for dropout calls at DROPOUT_PACKED's head
    dims (or where the config asks for it), off where the kernel is not built (problems())."""
    packed = (config.drop_packed or DROPOUT_PACKED.get(config.head_dim, 0)) if config.dropout else 0
    if packed != config.drop_packed:
        config = config.replace(drop_packed=packed)
    if config.drop_packed and any("drop_packed" in w for w in config.problems()):
        config = config.replace(drop_packed=0)
    return config


def feature_sched_kept(config, problem: Problem) -> bool:
    """Whether a config for ``problem`` keeps the plain schedule fields (FEATURE_SCHED_FLAGS) with its
    features: a fixed-length unordered call without dropout whose feature set FEATURE_SCHED_BUILT lists
    at the config's head dim, on the tile that builds them (Sm90BwdConfig.feature_sched_built)."""
    feats = tuple(problem.features)
    if not feats or "dropout" in feats or is_varlen(problem) or problem.deterministic:
        return False
    return config.replace(window="window" in feats, softcap="softcap" in feats,
                          alibi="alibi" in feats).feature_sched_built()


class Sm90Backward(Family):
    name = "sm90_bwd"
    op = "bwd"
    version = 1
    config_cls = Sm90BwdConfig
    space = {"BM": (64, 128), "BN": (64, 128), "stages": (2, 3), "consumers": (1, 2),
             "dq_bulk": (False, True), "overlap_sdp": (False, True), "dq_writer": (False, True),
             "dynamic": (False, True), "ds_double": (False, True), "dq_early": (False, True),
             "q_rotate": (False, True),
             "dk_late": (False, True), "frag_pin": (False, True), "roles": (False, True)}
    # (lpt, the launch order, is a config field outside the space: measured no faster than the
    # plain order, alone or with the dynamic scheduler; HEURISTIC_LPT below. s_ahead too: every
    # kernel it builds is serialized by ptxas (C7515) or spills, and the config refuses it)
    fixed = {"deterministic": False}
    params_struct = "Sm90BwdParams"
    kernel_param_decl = "const __grid_constant__ cuflash::Sm90BwdParams"
    # fa2_bwd's kernels (reused) take the BwdParams prefix of the same buffer
    kernel_param_decls = {"preprocess": "const cuflash::BwdParams", "convert_dq": "const cuflash::BwdParams",
                          "reduce_dkv": "const cuflash::BwdParams"}
    # (dq_tail's convert, sm90_bwd_dq_tail, takes the whole struct: it reads the tile counters)
    kernel_param_decls_by_kernel = {"cuflash::sm90_bwd_dq_tail": "const __grid_constant__ cuflash::Sm90BwdParams"}
    pointer_fields = FA2Backward.pointer_fields
    min_arch = (9, 0)
    arch_suffix = "a"
    priority = 1       # above fa2_bwd where it is faster: see rank()
    max_head_dim = HEAD_DIMS[-1]   # supports() refuses larger head dims: selection falls back
    dout_any_strides = True  # the preprocess reads dout through any strides (copies it if need be)
    description = ("Hopper backward: K/V-block CTAs, TMA ring of Q/dO, wgmma SS/RS, dQ by fp32 "
                   "red.add (or ordered, or bulk reduce-add: dq_bulk); fa2_bwd's preprocess / convert / "
                   "GQA kernels")

    def enumerate(self, problem: Problem, max_smem: Optional[int] = None):
        """Family.enumerate, with the d 256 dq_writer kernel kept out of the tuning space while
        HEURISTIC_D256_DQ_WRITER is off for its racecheck hazards (a tuner would pick it: it
        measured faster); bwd_config= still runs it. frag_pin is in the space at head dim 128 with
        dk_late only (session 16: no faster elsewhere)."""
        for cfg, why in super().enumerate(problem, max_smem):
            if not why and cfg.shared_keys and cfg.dq_writer and not HEURISTIC_D256_DQ_WRITER:
                why = ["dq_writer at head_dim=256: racecheck hazards (HEURISTIC_D256_DQ_WRITER), "
                       "outside the tuning space until fixed"]
            if not why and cfg.dynamic and cfg.shared_keys:
                why = ["dynamic at head_dim=256 (with roles, session 20): outside the tuning space until measured "
                       "(HEURISTIC_D256_DYNAMIC)"]
            if not why and cfg.frag_pin and not (cfg.head_dim == 128 and cfg.dk_late):
                # (frag_pin alone measured -1..+1% at d128, slower at d64 bf16: in the space where it is
                # the heuristic's, with dk_late at d128, which it lets run with the dynamic scheduler)
                why = ["frag_pin outside head_dim=128 with dk_late: outside the tuning space (no faster there)"]
            yield cfg, why

    @property
    def features(self) -> tuple:
        """The feature flags it runs; varlen only while VARLEN_BWD is on (read per call, so a test
        or CUFLASH_SM90_VARLEN_BWD=1 switches it)."""
        return ("alibi", "dropout", "softcap") + (("varlen",) if VARLEN_BWD else ()) + ("window",)

    def rank(self, problem: Problem) -> int:
        """Above fa2_bwd (priority 0) at every head dim it runs (<= 128), as measured on the H100:
        at d 128 (bench --mode fwdbwd, bf16, seqlens 2k..16k, causal and not; results/<gpu>/
        bench_fwdbwd.json) backward TFLOPs 1.3-1.6x fa2_bwd's; at d 64 (D64_ABOVE_FA2, the
        2-consumer BM128 tile) 1.26-1.38x and at d 96 (D96_ABOVE_FA2, its d-128 kernel)
        1.40-1.62x (tests/sm90_bwd_d64_timing.py, 2026-11-26). The one-consumer BM64 BN64 tile
        it had at d 64 before ran at 0.81-1.0x fa2_bwd.
        The same rule with window, softcap and ALiBi (the per-element work they add is the same
        in both families). Dropout follows the same rule while DROPOUT_BY_DEFAULT is on (else it
        ranks below fa2_bwd and bwd_config= forces it). D64_ABOVE_FA2 / D96_ABOVE_FA2 (module
        constants) switch head dims <= 64 / 65..96 back to fa2_bwd."""
        if "dropout" in problem.features and not DROPOUT_BY_DEFAULT:
            return -1
        d = problem.head_dim
        if "varlen" in problem.features and d <= 96:
            small, others = 64 if d <= 64 else 96, tuple(f for f in problem.features if f != "varlen")
            if not (small in VARLEN_SMALL_D if not others else others in VARLEN_SMALL_D_FEATURES.get(small, ())):
                return -1   # fa2_bwd where the 2-consumer tiles are not timed (VARLEN_SMALL_D: plain varlen
                #             calls; VARLEN_SMALL_D_FEATURES: with window / softcap / ALiBi / dropout)
        if "varlen" in problem.features and 96 < d <= 128:
            others = tuple(f for f in problem.features if f != "varlen")
            if others and others not in VARLEN_D128_FEATURES:
                return -1   # fa2_bwd: a mix not timed at d128 (VARLEN_D128_FEATURES)
        if d > 128:
            above = D256_ABOVE_FA2 if d > 192 else D192_ABOVE_FA2
        else:
            above = d > 96 or (D64_ABOVE_FA2 if d <= 64 else D96_ABOVE_FA2)
        return self.priority if above else -1

    def supports(self, arch, problem: Problem) -> str:
        why = (f"{self.name} implements op {self.op!r}, not {problem.op!r}" if problem.op != self.op
               else check_head_dim(problem) or self.feature_problem(problem)
               or feature_mix(self, problem) or self.dropout_mix(problem) or self.varlen_mix(problem))
        if why:
            return why
        if problem.head_dim > HEAD_DIMS[-1]:
            return (f"{self.name} supports headdim up to {HEAD_DIMS[-1]} (kernels for {HEAD_DIMS}), "
                    f"got headdim={problem.head_dim}")
        if "dropout" in problem.features and problem.deterministic and self.head_dim_of(problem.head_dim) == 128:
            return (f"{self.name} has no deterministic dropout at head dims 65..128 (its d128 kernel "
                    f"spills), got headdim={problem.head_dim}")
        if tuple(arch)[0] != 9:
            return (f"{self.name} needs sm_90 exactly (sm_90a code: wgmma, TMA, setmaxnreg), "
                    f"got sm_{arch[0]}{arch[1]}")
        return ""

    def dropout_mix(self, problem: Problem) -> str:
        """Dropout with window / softcap / ALiBi where its instantiation compiles without spills
        (nvcc 13.0, sm_90a): not deterministic, and not a window with softcap or ALiBi at d128
        (Sm90BwdConfig.dropout_dq_path: every dQ path spills 4-12 bytes); elsewhere selection
        falls back to fa2_bwd. tests/test_dropmix_cpu.py holds the allowed set to zero spills."""
        why = dropout_mix(self, problem)
        if not why:
            return ""
        if problem.deterministic:
            return why + " and deterministic=True (unchecked)"
        feats = problem.features
        if self.head_dim_of(problem.head_dim) == 128 and "window" in feats \
                and ("softcap" in feats or "alibi" in feats):
            return why + f" with a window at head dim {problem.head_dim} (its instantiation spills)"
        if self.head_dim_of(problem.head_dim) == 256:
            return why + f" at head dim {problem.head_dim} (the d256 instantiations spill)"
        return ""

    def varlen_mix(self, problem: Problem) -> str:
        """'' unless ``problem`` is varlen with a feature set outside VARLEN_FEATURES, or
        deterministic above head dim 64; selection then falls back to fa2_bwd. (Without
        VARLEN_BWD ``features`` lacks varlen: feature_problem refuses it first.)"""
        if not is_varlen(problem):
            return ""
        others = tuple(f for f in problem.features if f != "varlen")
        if others and others not in VARLEN_FEATURES:
            return (f"{self.name} has no feature {others[0]!r} with varlen (features "
                    f"{', '.join(others)}: the varlen instantiation is unchecked)")
        if problem.deterministic and self.head_dim_of(problem.head_dim) == 128:
            return (f"{self.name} has no deterministic varlen backward at head dims 65..128 (its d128 "
                    f"kernel spills), got headdim={problem.head_dim}")
        return ""

    def head_dim_of(self, head_dim: int) -> int:
        """64, 128 or 256: the first compiled head dim >= the real one."""
        return next((d for d in HEAD_DIMS if d >= head_dim), HEAD_DIMS[-1])

    def for_problem(self, config, problem: Problem):
        # dropout alone on the drop_packed_fast tile: the speed fields a config asks for with drop_packed >= 2
        # (bwd_config=), else (drop_packed 0) DROPOUT_FAST's for the head dim, dtype and mask; applied at the
        # end where they build
        fast = None
        if tuple(problem.features) == ("dropout",) and not is_varlen(problem) and not problem.deterministic:
            if config.drop_packed >= 2:
                fast = {"drop_packed": config.drop_packed, **{k: getattr(config, k) for k in DROPOUT_FAST_FIELDS}}
            elif not config.drop_packed and DROPOUT_PACKED.get(config.head_dim, 0) >= 2:
                # (DROPOUT_PACKED's form 2 at this head dim; a config's form 1 is kept, without the fields)
                fast = DROPOUT_FAST.get((config.head_dim, config.dtype, bool(problem.causal)))
                fast = None if fast is None else {"drop_packed": 2, **fast}
        config = self._for_problem(config, problem)
        if fast is not None:
            cand = config.replace(**fast)
            if cand.drop_packed_fast() and not cand.problems(MAX_SMEM):
                return cand
        return config

    def _for_problem(self, config, problem: Problem):
        # the call's flag decides (tuned tables and the torch op's configs carry none)
        if config.deterministic != problem.deterministic:
            config = config.replace(deterministic=problem.deterministic)
        if config.dropout != ("dropout" in problem.features):
            config = config.replace(dropout="dropout" in problem.features)
        if config.varlen != is_varlen(problem):
            config = config.replace(varlen=is_varlen(problem))
        if config.lpt and (config.varlen or not config.causal):
            config = config.replace(lpt=False)         # a speed choice: varlen, non-causal keep the plain order
        sched = feature_sched_kept(config, problem)
        if config.dynamic and (config.varlen or config.deterministic or (config.shared_keys and not config.roles)
                               or (problem.features and not sched
                                   and (tuple(problem.features) not in DYNAMIC_FEATURES
                                        or config.head_dim not in WINDOW_BWD))):
            # likewise: a CTA per K/V block (with features the dynamic kernels are built but not
            # measured or run on a GPU yet: calls with features keep the plain grid, except the
            # sets of DYNAMIC_FEATURES when a config asks for it)
            config = config.replace(dynamic=False)
        if config.dq_bulk and (problem.deterministic or (config.dropout and config.consumers > 1
                                                        and config.head_dim == 64)):
            # a speed choice (a tuned entry's, or bwd_config='s): a deterministic call takes the
            # ordered red.add additions; d64 dropout with 2 consumers the red.add kernel (dq_bulk
            # spills it)
            config = config.replace(dq_bulk=False)
        config = self.with_features(config, problem)
        if config.cluster and (config.varlen or config.window or problem.deterministic):
            config = config.replace(cluster=False)     # a speed choice: those calls run one CTA per K/V block
        if config.dq_writer and problem.deterministic:
            config = config.replace(dq_writer=False)   # the ordered additions keep red.add
        if config.roles and (problem.deterministic or problem.features or config.overlap_sdp or not config.dq_writer):
            config = config.replace(roles=False)       # a speed choice: built for plain unordered calls
        if config.dynamic and config.shared_keys and not config.roles:
            config = config.replace(dynamic=False)     # (head dim 256: the dynamic scheduler with roles only)
        if config.dropout and config.head_dim == 128 and not problem.deterministic:
            # d128 dropout: the dQ path that compiles without spills for these features
            path = config.dropout_dq_path()
            if path is not None:
                config = config.replace(dq_writer=path == "dq_writer", dq_bulk=path == "dq_bulk")
        if config.overlap_sdp and config.overlap_sdp_refused():
            config = config.replace(overlap_sdp=False)  # the combinations whose kernel spills
        sched = sched and feature_sched_kept(config, problem)    # (the tile may have changed above)
        if config.ds_double and (config.head_dim != 128 or ((config.softcap or config.alibi) and not sched)
                                 or config.dropout):
            config = config.replace(ds_double=False)   # a speed choice, where it is not built
        if (config.s_ahead or config.dq_early or config.q_rotate or config.dk_late or config.frag_pin) \
                and problem.features:
            # a speed choice, measured on plain calls only: calls with features run without, except
            # the feature sets of FEATURE_SCHED_BUILT, which keep dq_early, dk_late and frag_pin
            keep = dict(dq_early=config.dq_early, dk_late=config.dk_late, frag_pin=config.frag_pin) if sched else {}
            config = config.replace(**{**dict(s_ahead=False, dq_early=False, q_rotate=False, dk_late=False,
                                              frag_pin=False), **keep})
        if (config.s_ahead or config.dq_early) and ((config.shared_keys and not config.roles) or config.overlap_sdp
                                                    or ((config.softcap or config.alibi) and not sched)
                                                    or config.dropout):
            config = config.replace(s_ahead=False, dq_early=False)   # a speed choice, where it is not built
        if config.dq_early and config.shared_keys:
            config = config.replace(dq_early=False)
        if config.s_ahead and config.roles:
            config = config.replace(s_ahead=False)     # (its wgmmas serialized: C7518)
        if config.q_rotate and (config.causal or config.window or config.deterministic or config.shared_keys
                                or config.softcap or config.alibi or config.dropout):
            config = config.replace(q_rotate=False)    # a speed choice, where it is not built
        if config.q_rotate and config.dk_late and config.dynamic and config.head_dim == 128 and config.dtype == "fp16":
            config = config.replace(q_rotate=False)    # likewise (that kernel spills)
        if config.s_ahead:
            config = config.replace(s_ahead=False)     # likewise (every kernel it builds spills or is serialized)
        if config.frag_pin and (config.shared_keys or ((config.softcap or config.alibi) and not sched)
                                or config.dropout):
            config = config.replace(frag_pin=False)    # a speed choice, where it is not built
        if config.dk_late and ((config.dynamic and config.head_dim == 128 and not config.frag_pin)
                               or not (config.dq_early and config.dq_writer and not config.s_ahead)):
            config = config.replace(dk_late=False)     # a speed choice, where it is not built
        if DROPOUT_PLAIN and config.dropout:
            # dropout alone at d128, non-causal, unordered: the plain heuristic's flags
            plain = config.replace(**DROPOUT_PLAIN_FLAGS)
            if plain.dropout_plain() and not plain.problems(MAX_SMEM):
                return with_drop_packed(plain)
        if config.BM == 80 and config.bm80_refused():
            config = config.replace(BM=64)               # a speed choice, where it is not built
        if config.dynamic and config.dynamic_spills():
            config = config.replace(dynamic=False)     # a speed choice: the combinations whose kernel spills
        if config.BM > 64 and config.bm128_spills():
            # FA3's BM 128 tile at head dim 64 (a tuned entry's, D64_SHAPE, bwd_config=): without
            # overlap_sdp where that is enough, else the BM 64 tile (dropout's keep bits, softcap,
            # ALiBi)
            lighter = config.replace(overlap_sdp=False)
            config = lighter if not lighter.bm128_spills() else lighter.replace(BM=64, overlap_sdp=config.overlap_sdp)
        if config.dq_convert and (problem.features not in ((), ("window",))
                                  or any("dq_convert" in w for w in config.problems())):
            config = config.replace(dq_convert=False)  # a speed choice: plain (or windowed) calls, dynamic scheduler
        if config.dq_first and (not dq_first_covers(problem, config.BM, config.BN)
                                or any("dq_first" in w for w in config.problems())):
            config = config.replace(dq_first=False)    # rows no K/V block adds to need the zeroed accumulator
        if config.wide_epi and (problem.features not in ((), ("window",), ("softcap",))
                                or any("wide_epi" in w for w in config.problems())):
            config = config.replace(wide_epi=False)    # a speed choice: plain (or windowed) fixed-length unordered calls
        if config.dq_tail and (problem.features not in ((), ("window",))
                               or any("dq_tail" in w for w in config.problems())):
            config = config.replace(dq_tail=0)         # a speed choice: plain (or windowed) calls, dynamic scheduler
        if config.cap_fold and any("cap_fold" in w for w in config.problems()):
            config = config.replace(cap_fold=0)        # the folded softcap step is built for softcap alone
        return with_drop_packed(config)

    def for_bounds(self, config, problem: Problem):
        """dq_first off where some Q block gets no dQ part (dq_first_covers with the call's window
        bounds and lengths: the choice, cached per class and bucket, cannot see them)."""
        if config.dq_first and not dq_first_covers(problem, config.BM, config.BN):
            config = config.replace(dq_first=False)
        return config

    def _fields(self, config):
        # dropout and varlen are not encoded (as sm90_fwd's): the call sets them (for_problem), so
        # the encoded form of a config stays what it was before the flags existed
        # lpt only when on, likewise
        return ((k, v) for k, v in super()._fields(config)
                if k not in ("dropout", "varlen")
                and not (k in ("lpt", "dynamic", "ds_double", "cluster", "s_ahead", "dq_early", "q_rotate", "dk_late",
                               "frag_pin", "roles", "dq_convert", "dq_first", "wide_epi", "drop_packed",
                               "cap_fold", "dq_tail")
                         and not v))

    def make(self, point, problem: Problem):
        """As Family.make; a point without dynamic or ds_double (tuned tables and recorded studies
        from before the flags) gets them off."""
        for flag in ("dynamic", "ds_double", "dq_early", "q_rotate", "dk_late", "frag_pin", "roles", "dq_convert",
                     "dq_first"):
            if flag not in point and flag in self.space:
                point = {**point, flag: False}
        # s_ahead left the space (refused: serialized); a recorded point that has it keeps its value
        # (True: a config that problems() refuses)
        # (dq_convert likewise while it is outside the space)
        out = {k: (int(point.get(k, 0)) if k == "dq_tail" else bool(point.get(k, False)))
               for k in ("s_ahead", "dq_convert", "dq_first", "wide_epi", "dq_tail") if k not in self.space}
        cfg = super().make({k: v for k, v in point.items() if k not in out}, problem)
        return cfg.replace(**{k: v for k, v in out.items() if v}) if any(out.values()) else cfg

    def heuristic(self, problem: Problem, arch=(9, 0), max_smem: Optional[int] = None) -> Sm90BwdConfig:
        """Head dim 128: FA3's shape with 2 consumer warpgroups (BN = 128 keys) and Q blocks of
        64 (dQ_i split by head-dim halves); head dim 64: D64_SHAPE (BM, BN, consumers), FA3's
        BM128 BN128 with 2 consumers (for_problem moves BM 128 to 64 with softcap, ALiBi or
        dropout). dQ by the writer warp (dq_writer)
        except where for_problem changes it (deterministic; d128 dropout: dropout_dq_path): measured on the H100
        (tests/sm90_bwd_sched_timing.py, the tuner's sweep), 13-22% faster than the consumers'
        red.add at d64 and d128, bf16 and fp16, causal or not, 2k-16k. The dynamic scheduler for the
        plain calls of the classes in HEURISTIC_DYNAMIC (measured there), lpt and ds_double per
        HEURISTIC_LPT / HEURISTIC_DS_DOUBLE (off)."""
        d = self.head_dim_of(problem.head_dim)
        max_smem = default_max_smem(arch) if max_smem is None else max_smem
        dtype, causal, det = problem.dtype, bool(problem.causal), problem.deterministic
        if d == 256:   # BN 64 shared by 2 consumers (the only tile that fits); dQ by red.add
            cfg = Sm90BwdConfig(64, 64, 2, 2, d, dtype, causal, det)
        elif d == 128:
            cfg = Sm90BwdConfig(64, 128, 2, 2, d, dtype, causal, det)
        else:
            BM, BN, consumers = D64_SHAPE
            cfg = Sm90BwdConfig(BM, BN, 2, consumers, d, dtype, causal, det)
        if not det and (d != 256 or HEURISTIC_D256_DQ_WRITER):
            cfg = cfg.replace(dq_writer=True)
        if d == 256 and dtype in HEURISTIC_D256_ROLES and cfg.dq_writer and not problem.features:
            cfg = cfg.replace(roles=True)
        if d == 256 and HEURISTIC_D256_CLUSTER and not det and not problem.features:
            cfg = cfg.replace(cluster=True)             # (for_problem drops it where it does not run)
        if causal and (HEURISTIC_D256_LPT if d == 256 else HEURISTIC_LPT):
            cfg = cfg.replace(lpt=True)                 # (for_problem drops it under varlen)
        dyn_cap = DYNAMIC_MAX_SEQLEN_BY.get((d, causal, dtype))
        if ((d, causal) in HEURISTIC_DYNAMIC and d != 256 and not det and not problem.features
                and (dyn_cap is None or problem.seqlen_q <= dyn_cap)):
            cfg = cfg.replace(dynamic=True)             # (for_problem drops it where it does not run)
        d256_dyn = HEURISTIC_D256_DYNAMIC.get((causal, dtype))
        if (d == 256 and cfg.roles and d256_dyn is not None and problem.seqlen_q >= d256_dyn and not det
                and not is_varlen(problem) and not cfg.replace(dynamic=True).problems()):
            cfg = cfg.replace(dynamic=True)             # (roles' dynamic kernel, HEURISTIC_D256_DYNAMIC)
        if HEURISTIC_DS_DOUBLE and d == 128:
            cfg = cfg.replace(ds_double=True)           # (likewise: not with softcap, ALiBi, dropout)
        plain = d != 256 and not problem.features
        if (d, causal) in HEURISTIC_FRAG_PIN and plain and not det and not cfg.replace(frag_pin=True).problems():
            cfg = cfg.replace(frag_pin=True)            # (for_problem drops it with softcap, ALiBi, dropout)
        # (each where the config builds it: s_ahead not next to dq_early or q_rotate, bf16 only;
        # dk_late with dq_early and ds_double, at d128 on the plain grid unless frag_pin lets it keep
        # the dynamic scheduler)
        late = not det and (d, causal) in HEURISTIC_DK_LATE
        rotate = d in HEURISTIC_Q_ROTATE or (d, dtype) in HEURISTIC_Q_ROTATE
        for flags, on in (({"q_rotate": True}, not det and not causal and rotate),
                          ({"dq_early": True}, not det and (d, causal) in HEURISTIC_DQ_EARLY),
                          ({"s_ahead": True}, not det and (d, causal, dtype) in HEURISTIC_S_AHEAD),
                          ({"dq_early": True, "dk_late": True, "ds_double": d == 128,
                            "dynamic": cfg.dynamic and (d != 128 or cfg.frag_pin)}, late)):
            if plain and on and not cfg.replace(**flags).problems():
                cfg = cfg.replace(**flags)
        s3 = cfg.replace(stages=3, dynamic=False)      # (the dynamic scheduler runs stages 2 only)
        if (d, causal, dtype) in HEURISTIC_STAGES3 and plain and not det and not s3.problems():
            cfg = s3                                    # (first_fitting below: stages 2 where it does not fit)
        bm80 = cfg.replace(BM=80, frag_pin=False, dynamic=False)   # (its plain grid, without frag_pin)
        if HEURISTIC_BM80 and plain and not det and not bm80.problems():
            cfg = bm80                                  # (bf16 non-causal d128 plain calls: bm80_refused)
        dqc = cfg.replace(dq_convert=True)
        if ((d, causal, dtype) in HEURISTIC_DQ_CONVERT and problem.seqlen_q <= DQ_CONVERT_MAX_SEQLEN
                and not problem.features and not det and not dqc.problems()):
            cfg = dqc                                   # (the head dim 128 dynamic / 256 roles kernels)
        dqf = cfg.replace(dq_first=True)
        cap = DQ_FIRST_MAX_SEQLEN_BY.get((d, causal, dtype), DQ_FIRST_MAX_SEQLEN)
        if ((d, causal, dtype) in HEURISTIC_DQ_FIRST and (cap is None or problem.seqlen_q <= cap)
                and not problem.features and dq_first_covers(problem, cfg.BM, cfg.BN) and not dqf.problems()):
            cfg = dqf
        w16 = cfg.replace(wide_epi=True)
        w16_cap = WIDE_EPI_MAX_SEQLEN_BY.get((d, causal, dtype))
        # (MHA with whole 8-column groups only: the kernel's 4-byte stores serve the rest, wide_epi_fits)
        if ((d, causal, dtype) in HEURISTIC_WIDE_EPI and (w16_cap is None or problem.seqlen_q <= w16_cap)
                and problem.nheads == problem.nheads_kv and problem.head_dim % 8 == 0
                and not problem.features and not det and not is_varlen(problem) and not w16.problems()):
            cfg = w16
        feats = tuple(problem.features)
        cw16 = cfg.replace(wide_epi=True)
        if (feats == ("softcap",) and (d, causal, dtype) in SOFTCAP_WIDE_EPI and not det and not is_varlen(problem)
                and problem.nheads == problem.nheads_kv and problem.head_dim % 8 == 0 and not cw16.problems()):
            cfg = cw16                                  # (the kernel checks MHA and alignment again per call)
        if feats == ("window",) and not det and d in WINDOW_BWD:
            cfg = cfg.replace(**WINDOW_BWD[d])          # (first_fitting: the plain grid where it does not fit)
        wdqf = cfg.replace(dq_first=True)
        if (feats == ("window",) and (d, dtype) in WINDOW_DQ_FIRST and dq_first_covers(problem, cfg.BM, cfg.BN)
                and not wdqf.problems()):
            cfg = wdqf                                  # (for_bounds drops it where a Q block gets no part)
        ww16 = cfg.replace(wide_epi=True)
        if (feats == ("window",) and (d, dtype) in WINDOW_WIDE_EPI and not det and not is_varlen(problem)
                and problem.nheads == problem.nheads_kv and problem.head_dim % 8 == 0 and not ww16.problems()):
            cfg = ww16                                  # (the kernel checks MHA and alignment again per call)
        wdqc = cfg.replace(dq_convert=True)
        if feats == ("window",) and (d, dtype) in WINDOW_DQ_CONVERT and not det and not wdqc.problems():
            cfg = wdqc                                  # (the dynamic kernel's: first_fitting may drop dynamic)
        wdqt = cfg.replace(dq_tail=WINDOW_DQ_TAIL.get((d, dtype, causal), 0))
        if (feats == ("window",) and wdqt.dq_tail and not det and not is_varlen(problem)
                and not wdqt.problems()):
            cfg = wdqt                                  # (for_problem drops it where the grid is not dynamic)
        if feats in FEATURE_SCHED.get((d, dtype), ()) and not det and not is_varlen(problem):
            # the plain call's schedule fields on top (FEATURE_SCHED: measured per feature set)
            plain_cfg = self.heuristic(problem.replace(features=()), arch, max_smem)
            sched = cfg.replace(**{f: getattr(plain_cfg, f) or getattr(cfg, f) for f in FEATURE_SCHED_FLAGS})
            for c in (sched, sched.replace(dynamic=False)):   # (the plain grid where the dynamic kernel spills)
                if not c.replace(**{f: f in feats for f in ("alibi", "softcap", "window")}).problems(max_smem):
                    return with_cap_fold(c, problem, max_smem)
        return with_cap_fold(first_fitting(cfg, ({"stages": 2}, {"stages": 2, "dq_writer": False, "dynamic": False}),
                                           max_smem), problem, max_smem)

    def kernel_names(self, config) -> dict:
        targs = f"cuflash::{config.dtype}" + (", true" if config.varlen else "")   # fa2_bwd's kVarlen
        # dq_first: the preprocess without the accumulator's zeroing (kZeroDq false; never varlen)
        pre = f"cuflash::{config.dtype}, false, false" if config.dq_first else targs
        # dq_tail: sm90_bwd_dq_tail in convert_dq's place (its dQ convert as the main kernel's dependent)
        convert = (f"cuflash::sm90_bwd_dq_tail<cuflash::{config.dtype}, {config.BN}>" if config.dq_tail
                   else f"cuflash::fa2_bwd_convert_dq<{targs}>")
        return {"main": config.kernel_name(),
                "preprocess": f"cuflash::fa2_bwd_preprocess<{pre}>",
                "convert_dq": convert,
                "reduce_dkv": f"cuflash::fa2_bwd_reduce_dkv<{targs}>"}

    def workspace(self, config, problem: Problem, strides: Optional[dict] = None) -> dict:
        """fa2_bwd's workspace (the shared kernels read it): fp32 lse_log2, D, dQ accumulators
        (head_dim_rounded = the kernel's head dim), dK/dV ones under GQA, dQ turn counters when
        deterministic, and dout_copy when TMA cannot read dout in place; with dq_first the
        per-Q-block tickets in dq_semaphore's place (int32, seqlen_q_rounded / 16 a pair, zeroed by
        the preprocess), after the rest."""
        ws = FA2Backward.workspace(self, config, problem, strides)
        if config.dq_first and "dq_semaphore" not in ws:
            rows = -(-problem.seqlen_q // ROW_PAD) * ROW_PAD
            ws["dq_semaphore"] = ws["total"]
            ws["total"] += -(-(problem.batch * problem.nheads * (rows // 16) * 4) // 256) * 256
        return ws

    def launches(self, config, problem: Problem, sm_count: int) -> list:
        p = problem
        n_kv = -(-p.seqlen_k // config.BN)
        if config.cluster:    # clusters of 2 K/V blocks of one (head, batch): an even count
            n_kv += n_kv % 2
        if p.batch * p.nheads * n_kv >= 2 ** 31:  # gridDim.x
            raise ValueError(f"batch * nheads * seqlen_k: too many K/V blocks for one launch "
                             f"({p.batch * p.nheads} x {n_kv})")
        rows = -(-p.seqlen_q // ROW_PAD) * ROW_PAD
        per_row = p.head_dim // 8  # epilogue threads per row
        tiles = p.batch * p.nheads * n_kv
        out = [LaunchSpec("preprocess", (rows // PREP_ROWS, p.nheads, p.batch), PREP_THREADS),
               # one CTA per (K/V block, head, batch), K/V blocks fastest (sm90_bwd.cu); dynamic: a CTA
               # per SM (one fits an SM), at most one per tile, claiming tiles
               LaunchSpec("main", (min(tiles, sm_count) if config.dynamic else tiles, 1, 1), config.threads,
                          config.smem_bytes)]
        if config.dq_tail:   # two CTAs an SM, a programmatic dependent of the main kernel (Sm90BwdDqTail)
            out.append(LaunchSpec("convert_dq", (DQ_TAIL_CTAS_PER_SM * sm_count, 1, 1), DQ_TAIL_THREADS, pdl=True))
        elif not config.dq_convert:   # (dq_convert: the main kernel converts dQ itself)
            out.append(LaunchSpec("convert_dq", (-(-p.seqlen_q * per_row // EPILOGUE_THREADS), p.nheads, p.batch),
                                  EPILOGUE_THREADS))
        if p.nheads != p.nheads_kv:
            out.append(LaunchSpec("reduce_dkv", (-(-p.seqlen_k * per_row // EPILOGUE_THREADS),
                                                 p.nheads_kv, p.batch), EPILOGUE_THREADS))
        return out

    def static_params(self, config, problem, strides, workspace, softmax_scale, sm_count) -> dict:
        # BwdParams' fields as fa2_bwd packs them (its reused kernels read them; the varlen
        # fields are zeros for a fixed-length call; the dropout threshold and scale, window
        # bounds, softcap factors and ALiBi stride are the main kernel's; the slopes' and the
        # rng state's addresses are written per call, as for fa2_bwd), K/V blocks in
        # plain order (head_group 1) or, with lpt, in fa2_bwd's groups of head_group pairs (two
        # waves of CTAs; CUFLASH_BWD_HEAD_GROUP fixes it); the tensor maps are written per call (call_writer; tma_dq
        # only with dq_writer)
        group = head_group(problem.batch * problem.nheads, -(-problem.seqlen_k // config.BN), sm_count) \
            if config.lpt else 1
        return dict(bwd_params(config, problem, strides, workspace, softmax_scale, group),
                    tma_q=0, tma_k=0, tma_v=0, tma_do=0, tma_dq=0, tile_counter=0)

    def zeroed_counters(self, config, problem: Problem) -> dict:
        """{params field: int32 count} of the counters a plan keeps between calls (cuflash.launch.Plan
        zeroes them once; the kernel resets them): the dynamic scheduler's tile counter. One buffer
        per CUDA stream (cuflash.launch.StreamCounters): calls on two streams may overlap."""
        if config.dq_convert:   # + the dQ convert's queue head, tail, per-pair counts and job slots (Sm90BwdDqQueue)
            pairs, chunks, q = problem.batch * problem.nheads, -(-problem.seqlen_q // DQ_CONVERT_ROWS), DQ_CONVERT_QUEUES
            return {"tile_counter": 2 + 2 * q + pairs + q * (-(-pairs // q) * chunks)}
        if config.dq_tail:      # + the convert's ticket, its finished CTAs and the per-pair tile counts (Sm90BwdDqTail)
            return {"tile_counter": 3 + problem.batch * problem.nheads}
        return {"tile_counter": 1} if config.dynamic else {}

    def call_writer(self, config, problem: Problem, strides: dict, struct):
        """Per call, after the pointers: the tensor maps of q, k, v and dO into the packed params
        ``buf`` (uint8). ``ptrs`` are the pointer fields' values (the op's tensors, then the
        workspace pieces): dO's map is built on dout itself, or on the preprocess's contiguous
        dout_copy when the workspace has that piece (TMA needs 16-byte strides and a contiguous
        head dim)."""
        p = problem
        names = self.pointer_fields
        copy = "dout_copy" in self.workspace(config, problem, strides)
        do_index = names.index("dout_copy") if copy else names.index("dout")
        do_strides = contiguous_strides(p) if copy else tuple(strides["dout"])
        shapes = sm90_fwd.map_shapes(p, strides)    # varlen: the packed tensors as one batch
        qshape, kshape = shapes["q"], shapes["k"]
        jobs = ((names.index("q"), "tma_q", qshape, tuple(strides["q"]), config.BM),
                (names.index("k"), "tma_k", kshape, tuple(strides["k"]), config.BN),
                (names.index("v"), "tma_v", kshape, tuple(strides["v"]), config.BN),
                (do_index, "tma_do", qshape, do_strides, config.BM))
        offsets = [struct.fields[f][1] for _, f, *_ in jobs]
        if offsets != list(range(offsets[0], offsets[0] + 4 * 128, 128)):
            raise RuntimeError(f"{self.params_struct}: tma_q, tma_k, tma_v, tma_do must be adjacent")
        start, end = offsets[0], offsets[0] + 4 * 128
        dtype = p.dtype
        index = tuple(i for i, *_ in jobs)
        blobs: dict = {}

        def write(buf, ptrs):
            key = tuple(ptrs[i] for i in index)
            blob = blobs.get(key)
            if blob is None:
                if len(blobs) >= 64:
                    blobs.clear()
                blob = blobs[key] = np.frombuffer(b"".join(
                    tensor_map(dtype, ptrs[i], shape, st, r) for i, _, shape, st, r in jobs), np.uint8)
            buf[start:end] = blob

        if not config.dq_writer:
            return write
        # dq_writer: the map of the fp32 dQ accumulator (workspace piece dq_accum), written after
        # the four 16-bit ones
        dq_off = struct.fields["tma_dq"][1]
        dq_index = names.index("dq_accum")
        ws_shape = (p.batch * p.nheads, -(-p.seqlen_q // ROW_PAD) * ROW_PAD, config.head_dim)
        if is_varlen(p):   # fa2_bwd's varlen workspace: (nheads, ws_rows) rows
            ws_shape = (p.nheads, varlen_ws_rows(strides["totals"][0], p.batch), config.head_dim)
        dq_blobs: dict = {}

        def write_dq(buf, ptrs):
            write(buf, ptrs)
            ptr = ptrs[dq_index]
            blob = dq_blobs.get(ptr)
            if blob is None:
                if len(dq_blobs) >= 64:
                    dq_blobs.clear()
                blob = dq_blobs[ptr] = np.frombuffer(dq_accum_map(ptr, ws_shape, config.BM), np.uint8)
            buf[dq_off:dq_off + 128] = blob

        return write_dq


def dq_first_covers(problem: Problem, BM: int = 64, BN: int = 128) -> bool:
    """Whether every query row of the call gets a dQ part from some K/V block (dq_first zeroes only
    the Q blocks that some K/V block visits, so a row that no K/V block adds to would keep garbage):
    fixed lengths, unordered, no feature but a window, and every Q block of BM rows in some K/V block's
    range at BN keys (cuflash.band every_q_block_visited: under the bottom-right causal mask, seqlen_q
    <= seqlen_k, every query then sees key 0; under a window, the call's bounds decide)."""
    from ..band import Band, every_q_block_visited

    if (problem.features not in ((), ("window",)) or problem.deterministic or is_varlen(problem)
            or problem.seqlen_k <= 0):
        return False
    if problem.features == ():
        return not problem.causal or problem.seqlen_q <= problem.seqlen_k
    return every_q_block_visited(Band(problem.seqlen_q, problem.seqlen_k, bool(problem.causal),
                                      tuple(problem.window)), BM, BN)


def lpt_tile(tile: int, n_kv: int, n_pairs: int, group: int) -> tuple:
    """(n_block, pair) of CTA ``tile`` in lpt's launch order: the host mirror of sm90_bwd_lpt_tile
    (kernels_cu/sm90_bwd.cu), for tests and tools."""
    first = tile // (group * n_kv) * group
    in_group = tile - first * n_kv
    width = min(group, n_pairs - first)
    return in_group // width, first + in_group % width


def dq_accum_map_args(ptr: int, shape, rows: int) -> tuple:
    """cuTensorMapEncodeTiled arguments of the fp32 dQ accumulator (dq_writer's tma_dq): shape
    (batch · nheads, seqlen_q_rounded, head_dim_rounded), contiguous; rank 3, innermost first;
    box 32 x rows x 1 (128 bytes a row: the 128B swizzle's span), 128B swizzle, as
    Sm90BwdDqWriterStage lays the staging tile out."""
    bh, seq, dim = shape
    return (CU_TENSOR_MAP_DATA_TYPE_F32, ptr, (dim, seq, bh), (dim * 4, seq * dim * 4),
            (32, rows, 1), sm90_fwd.SWIZZLE_128B, sm90_fwd.L2_PROMOTION_128B, sm90_fwd.OOB_FILL_ZEROS)


def dq_accum_map(ptr: int, shape, rows: int) -> bytes:
    """The encoded map of dq_accum_map_args (sm90_fwd's encoder: tests swap in a fake)."""
    return sm90_fwd._encoder(*dq_accum_map_args(ptr, shape, rows))


FAMILY = register(Sm90Backward())
