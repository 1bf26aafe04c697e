# session 30 sb1 round 3 (issue 12, as shipped): the GPU tests of the short-sequence kernels and the packed routes
# with the new defaults (d64 wide_epi backward, short-key forward BN), memcheck, then two timing processes (the new
# defaults against main's configs and SDPA in one process each) and ViT-B/16's training step.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
cells="64x197x12 128x128x12 32x512x12 64x577x16 8x2048x32 2x8192x32 fp16:64x197x12 fp16:8x2048x32"
common="--variants --long-variants --sdpa cudnn --no-fa2 --packed --reps 6 --b2b 5 --profile 0"
bg gcomp 20 python tests/test_short_seq_gpu.py --precompile
bg tcomp 20 python tests/short_seq_timing.py --compile-only --shapes $cells $common
wait
bg gputest 30 python -m pytest -q -p no:cacheprovider tests/test_short_seq_gpu.py tests/test_packed_grad_gpu.py
bg memcheck 30 compute-sanitizer --tool memcheck --print-limit 20 python tests/short_seq_sanitize.py
wait
step timeA 18 python tests/short_seq_timing.py --shapes $cells $common --out "$L/timeA.json"
step timeB 18 python tests/short_seq_timing.py --shapes $cells $common --out "$L/timeB.json"
step vit 14 python tests/models_vit_timing.py --batch 64 --iters 8 --out "$L/vit.json"
echo "total $(el) s" >> "$L/steps.log"
