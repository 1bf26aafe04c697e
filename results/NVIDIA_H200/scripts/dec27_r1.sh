# session 30 dec27 round 1 (issue 13 on one H200: batch 8 x 128k, 32 x 8k..128k, 64 x 8k at or above cuDNN): diagnosis.
# 1. the plain-read ceiling at 32x8k, 64x8k and 8x128k (grids: one CTA per group, splits, flat, claimed passes);
# 2. timing of the shipped call vs SDPA flash / cuDNN (CUDA graphs, 7 shuffled rounds, one process) and variants:
#    r1 plain loads, r5 L2::256B hint, o0 no interleave/early prefetch, x2 / x3 2x / 3x the splits, w4 4 warps at their
#    split rule (2 CTAs/SM), np no cluster pair (= the heuristic's kernel at 1-split cells: a noise reference);
# 3. ncu on one launch of each of SDPA flash, cuDNN and the shipped call at 32x8k, 64x8k and 8x128k (csv -> table);
# 4. a second timing process (fewer variants) if time is left.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
cells=(32x8k 64x8k 8x128k 32x32k 32x64k 32x128k)
var=(--variant "np REGS_CLUSTER_PAIRS=0" --variant "r1 regs=1" --variant "r5 regs=5"
     --variant "o0 regs_order=0 regs_prefetch=0 regs_prefetch_blocks=1" --variant "x2 xsplits=2" --variant "x3 xsplits=3"
     --variant "w4 warps=4")
bg pre 40 python3 tests/decode_b1_timing.py --precompile --processes 12 --cells "${cells[@]}" "${var[@]}"
step ceil 16 python3 tests/decode_read_ceiling.py --cells 32x8k 64x8k 8x128k --rounds 5 --out $OUT/ceil.json
wait
step time 30 python3 tests/decode_b1_timing.py --no-precompile --profile --repeat 7 --max-seconds 26 --cells "${cells[@]}" "${var[@]}" --out $OUT/time.json
m=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
m=$m,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum
m=$m,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active
m=$m,sm__cycles_active.avg,sm__cycles_active.min,sm__cycles_active.max,smsp__inst_executed.sum,smsp__issue_active.avg.per_cycle_active
m=$m,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum
m=$m,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic
m=$m,launch__shared_mem_per_block_static,launch__occupancy_limit_registers,launch__waves_per_multiprocessor
step ncu 24 ncu --profile-from-start off --csv --metrics $m python3 tests/decode_b1_timing.py --no-precompile --ncu --cells 32x8k 64x8k 8x128k
python3 tests/decode_ncu_probe.py --table < $L/ncu.log > $L/ncu_table.txt 2>&1
left=$(( 86 - $(el) ))
[ $left -gt 8 ] && step time2 $left python3 tests/decode_b1_timing.py --no-precompile --repeat 7 --max-seconds $(( left - 4 )) --cells 32x8k 64x8k 8x128k 32x32k 32x128k --variant "np REGS_CLUSTER_PAIRS=0" --variant "r1 regs=1" --variant "x2 xsplits=2" --out $OUT/time2.json
echo "total $(el) s"
