# session 29 mdl3 round 1: ViT / Baichuan / BTLM GPU tests (bf16 vs float64, 2x / 3x rules) and ViT-B/16 timing
# (cuflash vs SDPA in one process). Run from the archive's root with $OUT set.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step warm 25 python -m cuflash warmup --op fwd,bwd --dtype bf16 --hdim 64 --causal both --features alibi \
    --helpers rotary,layer_norm --processes 16
step gputest 35 python -m pytest -q -s -p no:cacheprovider tests/test_models_vit_baichuan_btlm_gpu.py
step timing 22 python tests/models_vit_timing.py --batch 64 --iters 20 --out "$L/timing.json"
echo "total $(el) s" >> "$L/steps.log"
