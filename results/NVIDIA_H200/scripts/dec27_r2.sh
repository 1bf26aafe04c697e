# session 30 dec27 round 2 (issue 13 on one H200): the grid levers round 1 pointed to, in two timing processes.
# Round 1: cuDNN runs 4 warps, two CTAs per SM, 1 split at 32 x 8k / 64 x 8k (all 256 CTAs resident at 32 x 8k);
# 4 warps (w4) came closest there, 3 splits (x3) won 1.4% at 32 x 64k / 128k. Variants (fields of the shipped
# config, fixed split counts): w4s1..w4s4 = 4 warps at 1..4 splits, s2/s3/s4/s6 = 8 warps at 2/3/4/6 splits,
# w4o0 = 4 warps, 1 split, no interleave/early prefetch. Then the candidate rules' GPU tests and memcheck.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
cells=(32x128k 32x64k 32x8k 64x8k 32x32k)
var=(--variant "w4s1 warps=4 splits=1" --variant "w4s2 warps=4 splits=2" --variant "w4s3 warps=4 splits=3"
     --variant "w4s4 warps=4 splits=4" --variant "s2 splits=2" --variant "s3 splits=3" --variant "s4 splits=4"
     --variant "s6 splits=6" --variant "w4o0 warps=4 splits=1 regs_order=0 regs_prefetch=0 regs_prefetch_blocks=1")
step pre 15 python3 tests/decode_b1_timing.py --precompile --processes 12 --cells "${cells[@]}" "${var[@]}"
step timeA 25 python3 tests/decode_b1_timing.py --no-precompile --repeat 7 --max-seconds 18 --cells "${cells[@]}" "${var[@]}" --out $OUT/timeA.json
step timeB 25 python3 tests/decode_b1_timing.py --no-precompile --repeat 7 --max-seconds 18 --cells "${cells[@]}" "${var[@]}" --out $OUT/timeB.json
step tests 16 python3 -m pytest -q -p no:cacheprovider tests/test_decode_batch_rules_gpu.py
left=$(( 88 - $(el) ))
[ $left -gt 5 ] && step mem $left compute-sanitizer --tool memcheck --print-limit 20 python3 tests/decode_batch_rules_sanitize.py
echo "total $(el) s"
