source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
V=(--variant "fc REGS_CLUSTER_PAIRS=0" --variant "cl2 regs_cluster=2 fused_combine=0 light_fence=0" --variant "w4cl4 warps=4 regs_cluster=4 fused_combine=0 light_fence=0")
PV=(--variant "fc 0" --variant "p16cl2 16 regs_cluster=2 fused_combine=0 light_fence=0" --variant "p256cl2 256 regs_cluster=2 fused_combine=0 light_fence=0")
bg pre_t 30 python3 tests/decode_precompile.py --only pair_tests --processes 6
bg pre 30 python3 tests/decode_b1_timing.py --precompile --processes 6 --cells 8x8k 8x32k 8x128k 32x8k "${V[@]}"
bg pre_p 30 python3 tests/decode_paged_timing.py --precompile --processes 4 --cells 8x32k "${PV[@]}"
wait
step time 32 python3 tests/decode_b1_timing.py --no-precompile --profile --repeat 7 --max-seconds 26 --cells 8x32k 8x8k 8x128k 32x8k "${V[@]}" --out $OUT/time.json
step paged 18 python3 tests/decode_paged_timing.py --no-precompile --rounds 7 --max-seconds 14 --cells 8x32k "${PV[@]}" --out $OUT/paged.json
step tests 30 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode_pair_gpu.py
echo "total $(el) s"
