# session 31 dec28 round 4 (one H200): the rest of regs_page_table 2's GPU tests off the GPU's table
# (test_decode_page_table2_gpu.py): first the 15 of round 3's selection its step limit cut (order 0 with the shift at
# the split rule's count, order 1 without it at 3 splits, graphs), then order 1 with the shift at 1 split and order 0
# without it at 3 splits (26) as far as the budget goes. Round 3's timing lost at 1 x 32k and 8 x 8k, so the H200 rule
# stays at batch 1 <= 8k.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
bg pret 24 python3 tests/decode_precompile.py --only page_table2_tests --processes 14
wait
k1="((splits3 and ro1 and rps0) and (l40000 or l30000 or l9000 or l20000 or rotary or alibi or page40))"
k1="$k1 or ((splits0 and ro0 and rps1) and (l30000 or l9000 or l20000 or rotary or alibi or page40)) or cuda_graph"
step tests 24 python3 -m pytest -q -rf -p no:cacheprovider tests/test_decode_page_table2_gpu.py -k "$k1"
step tests2 38 python3 -m pytest -q -rf -p no:cacheprovider tests/test_decode_page_table2_gpu.py -k "(splits1 and ro1 and rps1) or (splits3 and ro0 and rps0)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $L/smi.txt 2>&1
echo "total $(el) s"
