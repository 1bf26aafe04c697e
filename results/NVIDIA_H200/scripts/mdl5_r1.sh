# session 31 mdl5 round 1: timm's MAP head (global_pool="map", AttentionPoolLatent) on one H200. (1) the bf16 GPU
# tests of cuflash.models.vit and the families in tests/test_models_vit_baichuan_btlm_gpu.py: the 4 new ones (ViT
# "map" without class token / with it + fc_norm + fused LN; the pool alone, latent_len 3 over 197 / 1029 tokens,
# forward + gradients) and the 18 old ones as a regression check; (2) SigLIP-B/16-like ViT (no class token, MAP head)
# training step / forward at batch 64, cuflash against SDPA in the same process. Kernels warmed first.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step warm 20 python -m cuflash warmup --op fwd,bwd --dtype bf16 --hdim 64 --causal both --features alibi --varlen \
    --helpers rotary,layer_norm --processes 16
step gputest 32 python -m pytest -q -s -p no:cacheprovider -rf tests/test_models_vit_baichuan_btlm_gpu.py
step timing_map 28 python tests/models_vit_timing.py --global-pool map --batch 64 --iters 15 --out "$L/vit_map.json"
echo "total $(el) s" >> "$L/steps.log"
