# session 30 dec26 round 5 (one H200): the paged batch-1 rule with regs_page_shift as shipped (REGS_BATCH1_PAGED_RULES):
# users' calls (page16 / page256 rows, flash_attn_with_kvcache) against the previous rule's config (o16 / o256: no
# regs_page_shift) and the contiguous call in the same process (decode_paged_timing.py, CUDA graphs, 9 shuffled rounds),
# twice in two processes; then the shipped paged batch-1 rule's GPU tests (test_decode_staged_gpu.py batch1_paged_rule).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
var=(--variant "o16 16 regs_page_table=0 regs_page_shift=0" --variant "o256 256 regs_page_table=0 regs_page_shift=0")
bg pre 16 python3 tests/decode_paged_timing.py --precompile --processes 6 --cells 1x8k "${var[@]}"
bg pret 16 python3 tests/decode_precompile.py --only shipped_b1 --processes 10
wait
step paged 10 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged1.json
step paged2 10 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged2.json
step tests 20 python3 -m pytest -q -rf -p no:cacheprovider tests/test_decode_staged_gpu.py -k "batch1_paged_rule"
echo "total $(el) s"
