source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
CL="regs_cluster=2 fused_combine=0 light_fence=0"
V=(--variant "clt1 $CL regs_claim=1" --variant "clt2 $CL regs_claim=2" --variant "clt4 $CL regs_claim=4"
   --variant "clt16 $CL regs_claim=16" --variant "fct2 regs_claim=2" --variant "fct4 regs_claim=4")
PV=(--variant "p16t2 16 $CL regs_claim=2" --variant "p16t4 16 $CL regs_claim=4"
    --variant "p256t2 256 $CL regs_claim=2" --variant "p256t4 256 $CL regs_claim=4")
CELLS=(8x32k 8x8k 2x32k 8x64k 8x128k)
T=tests/test_decode_claim_gpu.py
bg pre 30 python3 tests/decode_b1_timing.py --precompile --processes 6 --cells "${CELLS[@]}" "${V[@]}"
bg pre_p 30 python3 tests/decode_paged_timing.py --precompile --processes 3 --cells 8x32k "${PV[@]}"
bg pre_t 30 python3 tests/decode_precompile.py --only regs_claim_tests --processes 6
wait
step time 24 python3 tests/decode_b1_timing.py --no-precompile --repeat 9 --max-seconds 20 --cells "${CELLS[@]}" "${V[@]}" --out $OUT/time.json
step paged 12 python3 tests/decode_paged_timing.py --no-precompile --rounds 9 --max-seconds 9 --cells 8x32k "${PV[@]}" --out $OUT/paged.json
bg ta 34 python3 -m pytest -q -p no:cacheprovider $T -k "cuda_graph or fused"
bg tb 34 python3 -m pytest -q -p no:cacheprovider $T -k "claim2"
bg tc 34 python3 -m pytest -q -p no:cacheprovider $T -k "claim16"
bg mem 34 compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/decode_claim_sanitize.py
bg race 34 compute-sanitizer --tool racecheck --error-exitcode 3 python3 tests/decode_claim_sanitize.py
bg sync 34 compute-sanitizer --tool synccheck --error-exitcode 3 python3 tests/decode_claim_sanitize.py
wait
echo "total $(el) s"
