# session 31 dec28 round 5 (the session's last GPU round, one H200): final-code confirmation of the H200 table's paged
# batch-1 rule (regs_page_table 2). Users' calls through the rule (page16 / page256) against the previous users' config
# (o16 / o256: regs_page_table 0) and the contiguous call at 1 x 8k (decode_paged_timing, CUDA graphs, 9 shuffled
# rounds, two processes); the option's GPU tests not yet run (append + rotary, the window with softcap and ALiBi, page
# 40, CUDA graphs); memcheck (39 calls) and racecheck (3 calls) of its calls.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
var=(--variant "o16 16 regs_page_table=0" --variant "o256 256 regs_page_table=0")
bg pre 22 python3 tests/decode_paged_timing.py --precompile --processes 4 --cells 1x8k "${var[@]}"
bg pret 22 python3 tests/decode_precompile.py --only page_table2_tests --processes 12
wait
step paged 10 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged1.json
step paged2 10 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged2.json
step tests 24 python3 -m pytest -q -rf -p no:cacheprovider tests/test_decode_page_table2_gpu.py -k "cuda_graph or ((rotary or alibi or page40) and ((splits0 and ro0 and rps1) or (splits3 and ro1 and rps0)))"
step memcheck 10 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/decode_page_table2_sanitize.py
step racecheck 10 compute-sanitizer --tool racecheck --error-exitcode 9 python3 tests/decode_page_table2_sanitize.py --quick
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $L/smi.txt 2>&1
echo "total $(el) s"
