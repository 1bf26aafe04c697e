# session 31 lead (after rev31's review): dq_tail at padded head dims (80 / 96 / 112 on the d128 kernel), GQA / MQA,
# the default route, within the 3x rule; and the CUDA-graph test again.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre 45 python3 tests/dq_tail_precompile.py --tests --defaults
step t_pad 120 python -m pytest -q -p no:cacheprovider tests/test_bwd_dq_tail_gpu.py -k "padded or cuda_graph"
echo "all done $(el)s" >> "$L/steps.log"
