# session 29 mdl3 round 2: the GPU tests again with ViT's init drawn in fp32 (round 1 found ±2 weights from a bf16
# truncated-normal draw on the GPU) plus its new init test, and the ViT-B/16 timing in two processes (noise check).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step warm 25 python -m cuflash warmup --op fwd,bwd --dtype bf16 --hdim 64 --causal both --features alibi \
    --helpers rotary,layer_norm --processes 16
step diag 10 python -c "import torch; t = torch.empty(768, 3072, device='cuda', dtype=torch.bfloat16); \
torch.nn.init.trunc_normal_(t, std=0.02); print('bf16 trunc_normal_ on cuda: |w| >= 1.9 in', \
(t.abs() >= 1.9).sum().item(), 'of', t.numel(), '; max', t.abs().max().item(), '; std', t.float().std().item())"
step gputest 30 python -m pytest -q -s -p no:cacheprovider tests/test_models_vit_baichuan_btlm_gpu.py
step timing 16 python tests/models_vit_timing.py --batch 64 --iters 30 --out "$L/timing.json"
step timing2 16 python tests/models_vit_timing.py --batch 64 --iters 30 --out "$L/timing2.json"
echo "total $(el) s" >> "$L/steps.log"
