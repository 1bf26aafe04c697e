source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
bg pre 32 python3 tests/decode_b1_timing.py --precompile --processes 8 --cells 8x32k 32x8k --variant "pdl1 pdl=1" --variant "pdl2 pdl=2" --variant "ro2 regs_order=2" --variant "cl2 regs_cluster=2 fused_combine=0 light_fence=0"
step ceil 30 python3 tests/decode_read_ceiling.py --cells 8x32k 32x8k --rounds 7 --out $OUT/ceil.json
wait
step time 24 python3 tests/decode_b1_timing.py --no-precompile --profile --repeat 7 --max-seconds 20 --cells 8x32k 32x8k --variant "pdl1 pdl=1" --variant "pdl2 pdl=2" --variant "ro2 regs_order=2" --variant "cl2 regs_cluster=2 fused_combine=0 light_fence=0" --out $OUT/time.json
step ncu 30 ncu --profile-from-start off --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_active.min,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__occupancy_limit_warps,lts__t_sectors_srcunit_tex_op_read.sum python3 tests/decode_b1_timing.py --no-precompile --ncu --cells 8x32k 32x8k
python3 tests/decode_ncu_probe.py --table < $L/ncu.log > $L/ncu_table.txt 2>&1
echo "total $(el) s"
