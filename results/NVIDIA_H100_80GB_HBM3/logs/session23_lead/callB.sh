#!/usr/bin/env bash
# session 23 call B, on an H200 (nvidia-h200): dec13's batch-1 rule (keyed by sm_90, measured on the H100 only)
# against the previous heuristic, the older loop and SDPA cuDNN / flash in one process, 1x8k..1x128k.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
V=(--variant "prev REGS_BATCH1=0" --variant "old REGS_DEFAULT=0")
CELLS="1x8k 1x16k 1x32k 1x64k 1x128k"
step pre 60 python3 tests/decode_b1_timing.py --precompile --cells $CELLS "${V[@]}" --processes 8
step b1 60 python3 tests/decode_b1_timing.py --no-precompile --cells $CELLS "${V[@]}" --repeat 7 --reps 7 --max-seconds 45 --out $L/b1_h200.json
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs && rm -rf logs
