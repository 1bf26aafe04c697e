# session 30 sb1 round 1 (issue 12, short-sequence attention): per-kernel GPU times and interleaved timing of
# cuflash's forward / backward against SDPA flash / cuDNN / efficient at ViT / BERT shapes (d 64, bf16,
# non-causal), sm90_bwd variants forced, the packed-qkv path, and the FA convention's 2k / 8k cells.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step short 82 python tests/short_seq_timing.py --packed --reps 8 --profile 4 --out "$L/short.json"
echo "total $(el) s" >> "$L/steps.log"
