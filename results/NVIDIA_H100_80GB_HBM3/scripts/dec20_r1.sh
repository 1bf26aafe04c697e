#!/usr/bin/env bash
# session 28 dec20 round 1 (issue 13, 1 x 8k decode against SDPA cuDNN): (a) the harness gap (bench vs the timing
# scripts: procedures, graph sizes, the int cache_seqlens) in one process; (b) the existing early-load levers with
# the shipped batch-1 rule (regs_order 2: the first block's loads before cache_seqlens; pdl 3; regs_prefetch);
# (c) ncu of the main kernel + combine against cuDNN's kernels (warm L2, boost clocks).
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
vs=(--variant "ord2 regs_order=2" --variant "ord1 regs_order=1" --variant "pdl3 pdl=3" --variant "pf regs_prefetch=1"
    --variant "ord2pf regs_order=2 regs_prefetch=1" --variant "il intlens=1" --variant "ord2il regs_order=2 intlens=1")
bg pre_t 20 python3 tests/decode_b1_timing.py --precompile --processes 8 --cells 1x8k 1x4k "${vs[@]}"
bg pre_h 20 python3 tests/decode_harness_gap.py --precompile --ctx 8192
wait
step gap 26 python3 tests/decode_harness_gap.py --ctx 8192 --rounds 9 --json $L/gap.json
step b1 24 python3 tests/decode_b1_timing.py --no-precompile --cells 1x8k 1x4k --reps 7 --repeat 9 --profile \
  --max-seconds 18 --out $L/b1.json "${vs[@]}"
step ncu 14 ncu --profile-from-start off --cache-control none --clock-control none --section SpeedOfLight \
  --section WarpStateStats --section LaunchStats --metrics sm__cycles_active.max,sm__cycles_active.avg,smsp__inst_executed.sum \
  --csv --page details python3 tests/decode_b1_timing.py --no-precompile --ncu --cells 1x8k --variant "ord2 regs_order=2"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv >> $L/gpu.txt 2>&1
echo "all done $(el)s" >> $L/steps.log
