#!/usr/bin/env bash
# session 29, the lead's check of the merged main on one NVIDIA H200 (ln3, mdl3, fd1 merged; dec23/24/25 logs only):
# GPU tests of what the session changed, the norms' host time, the fused MLP timing, and `bench --mode decode` over
# the full grid (the H200 decode table). Run from the checkout's root.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
bg pre_ln 40 python3 tests/layer_norm_precompile.py --processes 3
bg pre_da 30 python3 tests/dense_act_precompile.py
bg pre_w 80 python3 -m cuflash warmup --op fwd,bwd --dtype bf16,fp16 --hdim 64 --causal both --varlen --features alibi \
  --decode "batch=1..64,ctx=8k..128k,page=0,16,256" --helpers all --processes 12
wait
bg t_ln 70 python3 -m pytest -q -p no:cacheprovider -rf tests/test_layer_norm_gpu.py tests/test_cross_entropy_gpu.py
bg t_fd 60 python3 -m pytest -q -p no:cacheprovider -rf tests/test_fused_dense_gpu.py
bg t_mdl 90 python3 -m pytest -q -p no:cacheprovider -rf tests/test_models_gpt_gpu.py tests/test_models_bert_gpu.py \
  tests/test_models_families_gpu.py tests/test_models_vit_baichuan_btlm_gpu.py tests/test_generation_cg_gpu.py
wait
step bench_dec 90 python3 -m cuflash bench --mode decode --out $OUT/bench
step host_ln 20 python3 tests/layer_norm_host_timing.py --out "$L/host_ln.json" --calls 200 --rounds 9
step mlp 35 python3 tests/fused_mlp_timing.py --shapes 1.3b_16k,llama7b_16k --no-kernels --out "$L/mlp.json"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv >> $L/gpu.txt 2>&1
echo "all done $(el)s" >> $L/steps.log
