# (ran at 6c8a557, whose kernel had kPageAhead / regs_page_ahead; dropped after this round: the field is gone)
# session 30 dec26 round 1 (issue 13, paged 1 x 8k decode on one H200): regs_page_ahead (kPageAhead: a window of
# page ids per warp, each block's ids by shuffles; 2: the first window read with cache_seqlens) against the shipped
# paged call (page16 / page256 rows: flash_attn_with_kvcache as users call it on the H200) and the contiguous call in
# the same process (tests/decode_paged_timing.py: CUDA graphs, 9 shuffled rounds), twice in two processes; then the
# page-ahead GPU tests (splits 0 and the graph replays) and a memcheck of its calls.
# Variants: a1 / a2 (regs_page_ahead 1 / 2, top-down order), a2o1 (2 with the interleaved order), a2p3_16 (2 with
# pdl 3), u16 / u256 (the shipped config through the variant path: no staged table).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
var=()
for pg in 16 256; do
  var+=(--variant "a1_$pg $pg regs_page_table=0 regs_page_ahead=1" --variant "a2_$pg $pg regs_page_table=0 regs_page_ahead=2"
        --variant "a2o1_$pg $pg regs_page_table=0 regs_page_ahead=2 regs_order=1" --variant "u$pg $pg regs_page_table=0")
done
var+=(--variant "a2p3_16 16 regs_page_table=0 regs_page_ahead=2 pdl=3")
bg pre 24 python3 tests/decode_paged_timing.py --precompile --processes 8 --cells 1x8k "${var[@]}"
bg pret 24 python3 tests/decode_precompile.py --only page_ahead_tests --processes 8
wait
step paged 15 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged1.json
step paged2 15 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged2.json
step tests 18 python3 -m pytest -q -rf -p no:cacheprovider tests/test_decode_page_ahead_gpu.py -k "splits0 or cuda_graph"
step memcheck 14 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/decode_page_ahead_sanitize.py --quick
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $L/smi.txt 2>&1
echo "total $(el) s"
