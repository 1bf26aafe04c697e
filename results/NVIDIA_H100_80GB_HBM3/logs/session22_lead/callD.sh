#!/usr/bin/env bash
# session 22 call D, one H100, at the merged main: bench fwd bf16 + fp16 with 40 samples per timing (the
# default 20 left d 256 non-causal 2k at 1.005x / 0.999x SDPA cuDNN, its samples' spread 3-9%).
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
R=$OUT/res; mkdir -p $R
step fwd 170 python3 -m cuflash bench --mode fwd --reps 40 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R
step fwd_fp16 170 python3 -m cuflash bench --mode fwd --reps 40 --dtypes fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R/fp16
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
