#!/usr/bin/env bash
# session 29, the lead's rerun after the RecordPlan / _input_grads refactor (host Python of the norms, dense_act and
# fused_dense): their GPU tests and the models' (FusedDense projections, fused norms in the blocks).
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
bg pre_ln 40 python3 tests/layer_norm_precompile.py --processes 4
bg pre_da 30 python3 tests/dense_act_precompile.py
bg pre_w 50 python3 -m cuflash warmup --op fwd,bwd --dtype bf16,fp16 --hdim 64 --causal both --varlen --features alibi \
  --helpers rotary,cross_entropy --processes 8
wait
bg t_fd 60 python3 -m pytest -q -p no:cacheprovider -rf tests/test_fused_dense_gpu.py
bg t_ln 60 python3 -m pytest -q -p no:cacheprovider -rf tests/test_layer_norm_gpu.py
bg t_mdl 80 python3 -m pytest -q -p no:cacheprovider -rf tests/test_models_gpt_gpu.py tests/test_models_vit_baichuan_btlm_gpu.py
wait
step host_ln 20 python3 tests/layer_norm_host_timing.py --out "$L/host_ln.json" --calls 200 --rounds 9
echo "all done $(el)s" >> $L/steps.log
