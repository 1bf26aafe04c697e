#!/usr/bin/env bash
# session 22 call C, one H100, at the merged main: (1) decode_splitkv_regs (the new default) against the
# older loop (REGS_DEFAULT=0) and cuDNN in one process; (2) d256 2k/4k lazy rescale (the new default) against
# the old heuristic (nolazy) and cuDNN, bf16 and fp16.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
R=$OUT/res; mkdir -p $R
CELLS="1x8k 1x32k 1x64k 1x128k 8x32k 32x8k"
bg pre_dec 70 python3 tests/decode_tma_timing.py --precompile --no-candidates --cells $CELLS --pages 0 16 --processes 8 --propose "REGS_DEFAULT=0"
bg pre_fwd 70 python3 tests/sm90_fwd_cells_timing.py --only 256:0:2048,256:0:4096,256:1:2048 --rows heur,nolazy --precompile-only
wait
step dec 75 python3 tests/decode_tma_timing.py --no-precompile --no-candidates --cells $CELLS --pages 0 16 --compact --repeat 3 --max-seconds 60 --out $R/regs_vs_old.json --propose "REGS_DEFAULT=0"
step fwd_bf16 40 python3 tests/sm90_fwd_cells_timing.py --only 256:0:2048,256:0:4096,256:1:2048 --rows heur,nolazy --reps 30
step fwd_fp16 40 python3 tests/sm90_fwd_cells_timing.py --dtype fp16 --only 256:0:2048,256:0:4096,256:1:2048 --rows heur,nolazy --reps 30
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
