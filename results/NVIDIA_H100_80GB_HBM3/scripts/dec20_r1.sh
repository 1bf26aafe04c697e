#!/usr/bin/env bash
# session 28 dec20 round 1 (issue 13, 1 x 8k decode against SDPA cuDNN): (a) the harness gap (bench vs the timing
# scripts: procedures, graph sizes, the int cache_seqlens) in one process; (b) early-load levers on the shipped
# batch-1 rule: regs_order 2 (the first block's loads before cache_seqlens, as built in session 23), the new kSpec
# (regs_spec: those loads and Q's really issued before the length's load), the L1 prefetch, int lengths;
# (c) ncu of the main kernel + combine against cuDNN's kernels (warm L2, boost clocks); (d) kSpec's GPU tests.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
vs=(--variant "spec regs_order=2 regs_spec=1" --variant "spec2 regs_order=2 regs_spec=2" --variant "ord2 regs_order=2" --variant "ord1 regs_order=1"
    --variant "spec2pf1 regs_order=2 regs_spec=2 regs_prefetch=1" --variant "spec2pf3 regs_order=2 regs_spec=2 regs_prefetch=1 regs_prefetch_blocks=3"
    --variant "il intlens=1" --variant "spec2il regs_order=2 regs_spec=2 intlens=1")
bg pre_t 22 python3 tests/decode_b1_timing.py --precompile --processes 8 --cells 1x8k 1x4k "${vs[@]}"
bg pre_h 22 python3 tests/decode_harness_gap.py --precompile --ctx 8192
bg pre_s 22 python3 tests/decode_precompile.py --only spec_tests --processes 8
wait
step gap 22 python3 tests/decode_harness_gap.py --ctx 8192 --rounds 9 --json $L/gap.json
step b1 20 python3 tests/decode_b1_timing.py --no-precompile --cells 1x8k 1x4k --reps 7 --repeat 9 --profile \
  --max-seconds 14 --out $L/b1.json "${vs[@]}"
step ncu 12 ncu --profile-from-start off --cache-control none --clock-control none --section SpeedOfLight \
  --section WarpStateStats --section LaunchStats --metrics sm__cycles_active.max,sm__cycles_active.avg,smsp__inst_executed.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum \
  --csv --page details python3 tests/decode_b1_timing.py --no-precompile --ncu --cells 1x8k --variant "spec regs_order=2 regs_spec=1" --variant "spec2 regs_order=2 regs_spec=2"
step tests 12 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode_spec_gpu.py -k "batch1_rule and splits0 or cuda_graph"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv >> $L/gpu.txt 2>&1
echo "all done $(el)s" >> $L/steps.log
