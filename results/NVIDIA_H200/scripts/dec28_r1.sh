# session 31 dec28 round 1 (issue 13, paged 1 x 8k decode on one H200): regs_page_table 2 (kPageTable 2: the whole
# block table row staged in shared memory, every page id from there). The sm_90a SASS of the shipped paged kernel gives
# its global table reads the K/V loads' scoreboard (SB5, no DEPBAR counts), so each block's id read waits for the block
# just issued and the next attend waits for that id read: a table round trip per block on the critical path. With
# kPageTable 2 the ids come by LDS (their own scoreboards). Timed against the users' paged calls, the contiguous call and
# c_ro0 (the contiguous cache on the paged kernel's order 0: the ceiling of this change) in one process
# (tests/decode_paged_timing.py, CUDA graphs, 9 shuffled rounds), twice in two processes; then its GPU tests (a subset)
# and a memcheck of its calls.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
var=(--variant "c_ro0 0 regs_order=0 regs_spec=0")
for pg in 16 256; do
  var+=(--variant "t$pg $pg regs_page_table=2" --variant "t${pg}o1 $pg regs_page_table=2 regs_order=1")
done
bg pre 22 python3 tests/decode_paged_timing.py --precompile --processes 6 --cells 1x8k "${var[@]}"
bg pret 22 python3 tests/decode_precompile.py --only page_table2_tests --processes 10
wait
step paged 13 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged1.json
step paged2 13 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged2.json
step tests 16 python3 -m pytest -q -rf -p no:cacheprovider tests/test_decode_page_table2_gpu.py -k "(b1_q1_l8192 and splits0 and rps1) or (leftpad and splits3 and rps1 and ro0) or (l40000 and splits0 and rps1 and ro0) or (cuda_graph and page256)"
step memcheck 14 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/decode_page_table2_sanitize.py
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $L/smi.txt 2>&1
echo "total $(el) s"
