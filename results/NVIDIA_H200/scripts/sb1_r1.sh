# session 30 sb1 round 1 (issue 12, short-sequence attention): the packed-qkv gradient route's GPU tests, then
# per-kernel GPU times and interleaved timing of cuflash's forward / backward against SDPA flash / cuDNN /
# efficient at ViT / BERT shapes (d 64, bf16, non-causal), sm90_bwd variants forced, the packed-qkv path (new
# route, main's per-slice route, SDPA), and the FA convention's 2k / 8k cells.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
bg warm 22 python -m cuflash warmup --op fwd,bwd --dtype bf16,fp16 --hdim 64 --causal both --processes 8
bg warm128 22 python -m cuflash warmup --op fwd,bwd --dtype bf16 --hdim 128 --causal no --processes 2
bg warmdet 22 python -m cuflash warmup --op fwd,bwd --dtype bf16 --hdim 64 --causal both --deterministic --processes 3
bg shortc 22 python tests/short_seq_timing.py --compile-only
wait
step gputest 25 python -m pytest -q -p no:cacheprovider tests/test_packed_grad_gpu.py
step short 45 python tests/short_seq_timing.py --packed --reps 8 --profile 3 --out "$L/short.json"
echo "total $(el) s" >> "$L/steps.log"
