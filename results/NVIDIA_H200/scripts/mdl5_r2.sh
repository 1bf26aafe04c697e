# session 31 mdl5 round 2: (1) tests/attention_pool_dq_diag.py: why r1's ViT "map" latent / q.weight gradients were
# 3.8x / 4.3x the plain bf16 peer's error (passing only by the check's 1e-6 absolute slack): dq of one query over 30 /
# 197 keys, cuflash's kernels against an emulation of FA2's D = rowsum(dO * bf16 O), the plain bf16 attention and
# cuflash on mean-centered keys; and the r1 ViT case on three image draws with the pool's keys centered or not.
# (2) the rest of tests/test_models_vit_baichuan_btlm_gpu.py that r1's step timeout cut (15 tests, unchanged paths).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step warm 20 python -m cuflash warmup --op fwd,bwd --dtype bf16 --hdim 64 --causal both --features alibi --varlen \
    --helpers rotary,layer_norm --processes 16
bg diag 45 python tests/attention_pool_dq_diag.py --out "$L/dq_diag.json"
bg rest 45 python -m pytest -q -s -p no:cacheprovider -rf tests/test_models_vit_baichuan_btlm_gpu.py \
    -k "not vit_bf16_vs_float64 and not attention_pool_latent"
wait
echo "total $(el) s" >> "$L/steps.log"
