# session 30 mdl4 round 2: regression check at the final commit of everything that calls MHA's changed inner
# attention path (the ALiBi slopes now come from FlashSelfAttention / FlashCrossAttention.slopes_for, also in the
# KV-cache decode call): the MHA GPU tests (ALiBi + window, varlen, GQA fp16, cross, rotary, decode), the model
# families' and GPT's GPU tests, and this branch's model tests again. Kernels warmed first; the rest compile lazily.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step warm 22 python -m cuflash warmup --op fwd,bwd --dtype bf16,fp16 --hdim 64 --causal both --varlen \
    --features alibi,alibi+window --helpers rotary,layer_norm --processes 16
bg t_mha 34 python -m pytest -q -p no:cacheprovider -rf tests/test_mha_gpu.py
bg t_fam 34 python -m pytest -q -p no:cacheprovider -rf tests/test_models_families_gpu.py tests/test_models_gpt_gpu.py
bg t_new 34 python -m pytest -q -s -p no:cacheprovider -rf tests/test_models_vit_baichuan_btlm_gpu.py
wait
echo "total $(el) s" >> "$L/steps.log"
