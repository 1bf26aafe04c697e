# session 31 dec28 round 3 (one H200): can the H200's paged batch-1 rule (regs_page_table 2, rounds 1-2) widen? At
# 1 x 32k (2048 pages at page 16: the most that fit) and 8 x 8k, t16 / t256 (the H200 users' config, regs_page_table 0
# there, with regs_page_table 2) against the users' calls and the contiguous call in one process (decode_paged_timing,
# CUDA graphs, 9 shuffled rounds), twice in two processes; then the option's GPU tests off the GPU's table
# (test_decode_page_table2_gpu.py: every case at order 0 with the shift and split rule, every case at order 1 without
# the shift at 3 splits, graphs).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
var=(--variant "t16 16 regs_page_table=2 regs_prefetch=0 regs_prefetch_blocks=1"
     --variant "t256 256 regs_page_table=2 regs_prefetch=0 regs_prefetch_blocks=1")
bg pre 24 python3 tests/decode_paged_timing.py --precompile --processes 4 --cells 1x32k 8x8k "${var[@]}"
bg pret 24 python3 tests/decode_precompile.py --only page_table2_tests --processes 12
wait
step paged 13 python3 tests/decode_paged_timing.py --no-precompile --cells 1x32k 8x8k --rounds 9 "${var[@]}" --out $OUT/paged1.json
step paged2 13 python3 tests/decode_paged_timing.py --no-precompile --cells 1x32k 8x8k --rounds 9 "${var[@]}" --out $OUT/paged2.json
step tests 34 python3 -m pytest -q -rf -p no:cacheprovider tests/test_decode_page_table2_gpu.py -k "(splits0 and ro0 and rps1) or (splits3 and ro1 and rps0) or cuda_graph"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $L/smi.txt 2>&1
echo "total $(el) s"
