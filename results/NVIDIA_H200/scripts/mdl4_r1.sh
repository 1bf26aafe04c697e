# session 30 mdl4 round 1: the bf16 GPU tests of the new model options (ViT LayerScale / avgmax / timm's init modes,
# Falcon-RW ALiBi, BTLM alibi_scaling fixed / dynamic incl. KV-cache decoding, MHA alibi_train_seqlen on a packed
# batch) plus the session-29 cases of the same file as a regression check. Kernels warmed first (head dim 64 bf16,
# ALiBi, varlen, the fused LayerNorm and rotary helpers); the decode kernel compiles on first use.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step warm 22 python -m cuflash warmup --op fwd,bwd --dtype bf16 --hdim 64 --causal both --features alibi --varlen \
    --helpers rotary,layer_norm --processes 16
step gputest 34 python -m pytest -q -s -p no:cacheprovider tests/test_models_vit_baichuan_btlm_gpu.py
echo "total $(el) s" >> "$L/steps.log"
