# session 30 dec26 round 4 (issue 13, paged 1 x 8k decode on one H200): regs_page_shift (kPageShift: the page index by
# a shift for power-of-two pages instead of a division; round 3's ncu: with the contiguous call's very addresses the
# paged split kernel issued more instructions, with more short-scoreboard and dependency stalls) against the shipped
# paged call and the contiguous call (c_ro0: the paged kernel's order) in the same process (tests/decode_paged_timing.py,
# CUDA graphs, 9 shuffled rounds), twice in two processes; then its GPU tests (splits 0, the staged table, graphs) and
# a memcheck of its calls.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
var=(--variant "c_ro0 0 regs_order=0 regs_spec=0")
for pg in 16 256; do
  var+=(--variant "u$pg $pg regs_page_table=0" --variant "s$pg $pg regs_page_table=0 regs_page_shift=1")
done
bg pre 20 python3 tests/decode_paged_timing.py --precompile --processes 6 --cells 1x8k "${var[@]}"
bg pret 20 python3 tests/decode_precompile.py --only page_shift_tests --processes 10
wait
step paged 14 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged1.json
step paged2 14 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged2.json
step tests 22 python3 -m pytest -q -rf -p no:cacheprovider tests/test_decode_page_shift_gpu.py -k "splits0 or page_table or cuda_graph"
step memcheck 15 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/decode_page_shift_sanitize.py
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $L/smi.txt 2>&1
echo "total $(el) s"
