#!/usr/bin/env bash
# session 29, the lead's rerun after the layer_norm poison fix: the model / generation GPU tests that failed in
# s29_final.sh (test_greedy_generate_kvcache_equals_nocache[llama_gqa_rotary]), and the norms' GPU tests.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
bg pre_ln 40 python3 tests/layer_norm_precompile.py --processes 4
bg pre_w 60 python3 -m cuflash warmup --op fwd,bwd --dtype bf16,fp16 --hdim 64 --causal both --varlen --features alibi \
  --decode "batch=1..8,ctx=8k,page=0" --helpers all --processes 10
wait
bg t_mdl 90 python3 -m pytest -q -p no:cacheprovider -rf tests/test_models_gpt_gpu.py tests/test_models_bert_gpu.py \
  tests/test_models_families_gpu.py tests/test_models_vit_baichuan_btlm_gpu.py tests/test_generation_cg_gpu.py
bg t_ln 70 python3 -m pytest -q -p no:cacheprovider -rf tests/test_layer_norm_gpu.py tests/test_flash_ops_gpu.py -k "norm"
wait
echo "all done $(el)s" >> $L/steps.log
