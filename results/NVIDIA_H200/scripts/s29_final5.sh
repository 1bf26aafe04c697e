#!/usr/bin/env bash
# session 29, the lead's review fixes on one H200: the norms' first call beside F.rms_norm's (bench --mode startup's new
# rms_norm call), and the fused dense GPU tests after the inference routing change.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre_da 30 python3 tests/dense_act_precompile.py --processes 6
step t_fd 60 python3 -m pytest -q -p no:cacheprovider -rf tests/test_fused_dense_gpu.py
step startup 150 python3 -m cuflash bench --mode startup --startup-calls rms_norm --repeats 3 --out $OUT/bench
step mlp 40 python3 tests/fused_mlp_timing.py --shapes 1.3b_16k,llama7b_16k --no-kernels --out "$L/mlp.json"
echo "all done $(el)s" >> $L/steps.log
