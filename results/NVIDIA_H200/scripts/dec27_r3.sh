# session 30 dec27 round 3 (issue 13 on one H200): the H200 table's two new decode rules as users call them.
# heuristic = flash_attn_with_kvcache with tuning/configs/NVIDIA_H200_sm90.yaml's rules (32-64 x 8k: 4 warps, 1
# split; 32 x >= 64k: 3 splits); old = the arch heuristic's config (the call before the rules); w4s1 = 4 warps,
# 1 split (the first rule's config, timed where the rule does not reach: 4k / 16k, to bound its range).
# Two timing processes (A: every cell, B: the rule cells and the 16k probes), then the GPU tests and memcheck.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
var=(--variant "old REGS_CLUSTER_PAIRS=1" --variant "w4s1 warps=4 splits=1")
cellsA=(32x128k 32x64k 32x8k 64x8k 32x16k 64x16k 32x4k 64x4k 32x32k 64x32k)
cellsB=(32x128k 32x64k 32x8k 64x8k 32x16k 64x16k)
step pre 18 python3 tests/decode_b1_timing.py --precompile --processes 12 --cells "${cellsA[@]}" "${var[@]}"
step timeA 24 python3 tests/decode_b1_timing.py --no-precompile --repeat 7 --max-seconds 18 --cells "${cellsA[@]}" "${var[@]}" --out $OUT/timeA.json
step timeB 20 python3 tests/decode_b1_timing.py --no-precompile --repeat 7 --max-seconds 15 --cells "${cellsB[@]}" "${var[@]}" --out $OUT/timeB.json
step tests 16 python3 -m pytest -q -p no:cacheprovider tests/test_decode_batch_rules_gpu.py
left=$(( 88 - $(el) ))
[ $left -gt 5 ] && step mem $left compute-sanitizer --tool memcheck --print-limit 20 python3 tests/decode_batch_rules_sanitize.py
echo "total $(el) s"
