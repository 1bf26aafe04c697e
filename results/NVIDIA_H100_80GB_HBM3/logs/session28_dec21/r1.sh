source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
CL="regs_cluster=2 fused_combine=0 light_fence=0"
V=(--variant "clr2 $CL regs_claim=2" --variant "clr3 $CL regs_claim=3" --variant "clr4 $CL regs_claim=4"
   --variant "fc REGS_CLUSTER_PAIRS=0" --variant "fcr2 regs_claim=2" --variant "fcr3 regs_claim=3")
CELLS=(8x32k 8x8k 2x32k 8x64k 8x128k)
bg pre 32 python3 tests/decode_b1_timing.py --precompile --processes 8 --cells "${CELLS[@]}" "${V[@]}"
bg pre_t 32 python3 tests/decode_precompile.py --only regs_claim_tests --processes 6
wait
step time 32 python3 tests/decode_b1_timing.py --no-precompile --repeat 9 --max-seconds 28 --cells "${CELLS[@]}" "${V[@]}" --out $OUT/time.json
step tests 20 python3 -m pytest -q -p no:cacheprovider tests/test_decode_claim_gpu.py -k "cuda_graph or fused or claim2"
echo "total $(el) s"
