# session 31 lead: the H200 paged batch-1 rule narrowed to the class it was timed on (bf16, d 128, 32:8 heads, one
# query row): the shipped batch-1 paged rule's GPU tests (users' calls; table 2 exactly on the measured cases).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
bg pre1 40 python3 tests/decode_precompile.py --only page_table2_b1 --processes 8
bg pre2 40 python3 tests/decode_precompile.py --only shipped_b1 --processes 6
wait
step t_rule 80 python3 -m pytest -q -rf -p no:cacheprovider tests/test_decode_staged_gpu.py -k batch1_paged_rule
echo "all done $(el)s" >> "$L/steps.log"
