# session 29 mdl3 round 3: regression check of the GPT / BERT family GPU tests on wip/mdl3 (gpt.py gained the
# use_alibi / window_size / mlp_multiple_of / norm_head / muP switches and the new from_pretrained).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step warm 28 python -m cuflash warmup --op fwd,bwd --dtype bf16,fp16 --hdim 64 --causal both --varlen \
    --helpers rotary,layer_norm --processes 16
step gputest 42 python -m pytest -q -s -p no:cacheprovider tests/test_models_families_gpu.py \
    tests/test_models_bert_gpu.py tests/test_models_gpt_gpu.py
echo "total $(el) s" >> "$L/steps.log"
