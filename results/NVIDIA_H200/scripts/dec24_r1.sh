# session 29 dec24 round 1 (issue 13, batch >= 8 decode on one H200): where the gap is, and the first kStream timing.
# timing of the shipped call vs SDPA flash / cuDNN (CUDA graphs, 9 shuffled rounds, one process) with the fused
# combine (fc), its loop without the interleave/prefetch (fc0), kStream on 132 CTAs (stk; stkp3 with the first
# segment's 3-block early prefetch) and on 128 (stk128);
# kStream's GPU tests; ncu (SM-active spread, DRAM %) at 8x32k; the plain-reader ceiling at 8x32k.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
cells=(8x32k 8x8k 32x8k 64x32k 8x128k)
o0="light_fence=0 regs_order=0 regs_prefetch=0 regs_prefetch_blocks=1"
var=(--variant "fc REGS_CLUSTER_PAIRS=0" --variant "fc0 regs_order=0 regs_prefetch=0 regs_prefetch_blocks=1"
     --variant "stk stream=1 $o0" --variant "stkp3 stream=1 light_fence=0 regs_order=0 regs_prefetch=1 regs_prefetch_blocks=3"
     --variant "stk128 stream=1 $o0 splits=128")
bg pre 30 python3 tests/decode_b1_timing.py --precompile --processes 4 --cells "${cells[@]}" "${var[@]}"
bg pre_t 30 python3 tests/decode_precompile.py --only stream_regs_tests --processes 4
step ceil 14 python3 tests/decode_read_ceiling.py --cells 8x32k --rounds 5 --out $OUT/ceil.json
wait
step time 28 python3 tests/decode_b1_timing.py --no-precompile --repeat 9 --max-seconds 24 --cells "${cells[@]}" "${var[@]}" --out $OUT/time.json
step tests 20 python3 -m pytest -q -p no:cacheprovider tests/test_decode_stream_regs_gpu.py
step ncu 14 ncu --profile-from-start off --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_active.min,launch__grid_size,launch__registers_per_thread python3 tests/decode_b1_timing.py --no-precompile --ncu --cells 8x32k "${var[@]}"
python3 tests/decode_ncu_probe.py --table < $L/ncu.log > $L/ncu_table.txt 2>&1
echo "total $(el) s"
