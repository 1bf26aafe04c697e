# session 30 sb1 round 4 (issue 12, as shipped): the GPU tests round 3's timeout cut (forward short-key BNs; the packed
# routes with the new defaults), two timing processes at GPU-bound cells (new defaults vs main's configs vs SDPA cuDNN),
# ViT-B/16's training step (cuflash vs SDPA).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
cells="256x197x12 256x128x12 128x512x12 64x577x16 8x2048x32 2x8192x32 fp16:256x197x12"
common="--variants --long-variants --sdpa cudnn --no-fa2 --reps 6 --b2b 10 --profile 0"
bg gcomp 20 python tests/test_short_seq_gpu.py --precompile
bg warm 20 python -m cuflash warmup --op fwd,bwd --dtype bf16,fp16 --hdim 64 --causal both --processes 4
bg warm2 20 python -m cuflash warmup --op fwd,bwd --dtype bf16 --hdim 128 --causal no --processes 1
bg warmdet 20 python -m cuflash warmup --op bwd --dtype bf16 --hdim 64 --causal both --deterministic --processes 1
bg tcomp 20 python tests/short_seq_timing.py --compile-only --shapes $cells $common
wait
bg gputest 22 python -m pytest -q -p no:cacheprovider tests/test_short_seq_gpu.py -k forward_short_bn
bg gputest2 22 python -m pytest -q -p no:cacheprovider tests/test_packed_grad_gpu.py
wait
step timeA 16 python tests/short_seq_timing.py --no-precompile --shapes $cells $common --out "$L/timeA.json"
step timeB 16 python tests/short_seq_timing.py --no-precompile --shapes $cells $common --out "$L/timeB.json"
step vit 14 python tests/models_vit_timing.py --batch 64 --iters 8 --out "$L/vit.json"
echo "total $(el) s" >> "$L/steps.log"
