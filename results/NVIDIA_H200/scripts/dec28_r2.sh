# session 31 dec28 round 2 (issue 13, one H200): the H200 table's new paged batch-1 rule (batch 1, at most 8192 keys:
# regs_page_table 2, the whole table row staged, every page id from shared memory; round 1 won at pages 16 and 256 in
# both processes). Users' calls (page16 / page256 rows, flash_attn_with_kvcache with the table's rule) against the
# previous users' config (o16 / o256: regs_page_table 0) and the contiguous call in one process (decode_paged_timing,
# CUDA graphs, 9 shuffled rounds), at 1 x 8k and 1 x 4k, twice in two processes; then the shipped paged batch-1 rule's
# GPU tests (test_decode_staged_gpu.py batch1_paged_rule: users' calls, now regs_page_table 2 on the H200) and a
# racecheck of the new option's full-row calls.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
var=(--variant "o16 16 regs_page_table=0" --variant "o256 256 regs_page_table=0")
bg pre 20 python3 tests/decode_paged_timing.py --precompile --processes 6 --cells 1x8k 1x4k "${var[@]}"
bg pret 20 python3 tests/decode_precompile.py --only page_table2_b1 --processes 6
wait
step paged 12 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k 1x4k --rounds 9 "${var[@]}" --out $OUT/paged1.json
step paged2 12 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k 1x4k --rounds 9 "${var[@]}" --out $OUT/paged2.json
step tests 24 python3 -m pytest -q -rf -p no:cacheprovider tests/test_decode_staged_gpu.py -k "batch1_paged_rule"
step racecheck 12 compute-sanitizer --tool racecheck --error-exitcode 9 python3 tests/decode_page_table2_sanitize.py --quick
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $L/smi.txt 2>&1
echo "total $(el) s"
