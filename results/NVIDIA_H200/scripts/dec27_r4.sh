# session 30 dec27 round 4 (issue 13 on one H200): the 4-warp rule widened to 4k-8k keys (batch 32-64), which round 3
# timed in one process only (w4s1 at 32 x 4k / 64 x 4k). Two timing processes: heuristic = flash_attn_with_kvcache
# with the H200 table's rules, old = the arch heuristic's config; then the rules' GPU tests (a 4k case added) and
# memcheck (a 4k call added).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
var=(--variant "old REGS_CLUSTER_PAIRS=1")
cells=(32x4k 64x4k 32x8k 64x8k)
step pre 15 python3 tests/decode_b1_timing.py --precompile --processes 8 --cells "${cells[@]}" "${var[@]}"
step timeA 12 python3 tests/decode_b1_timing.py --no-precompile --repeat 7 --max-seconds 9 --cells "${cells[@]}" "${var[@]}" --out $OUT/timeA.json
step timeB 12 python3 tests/decode_b1_timing.py --no-precompile --repeat 7 --max-seconds 9 --cells "${cells[@]}" "${var[@]}" --out $OUT/timeB.json
step tests 16 python3 -m pytest -q -p no:cacheprovider tests/test_decode_batch_rules_gpu.py
left=$(( 75 - $(el) ))
[ $left -gt 5 ] && step mem $left compute-sanitizer --tool memcheck --print-limit 20 python3 tests/decode_batch_rules_sanitize.py
echo "total $(el) s"
