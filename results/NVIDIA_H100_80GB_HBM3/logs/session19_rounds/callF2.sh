#!/usr/bin/env bash
# session 19 final call, command 2, at the merged main: bench fwdbwd bf16 + fp16, peak memory, features,
# the CuPy backward's host time (overhead)
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
R=$OUT/res; mkdir -p $R
step fwdbwd 150 python3 -m cuflash bench --mode fwdbwd --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R
step fwdbwd_fp16 150 python3 -m cuflash bench --mode fwdbwd --dtypes fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R/fp16
step overhead 45 python3 -m cuflash bench --mode overhead --out $R
step memory 60 python3 -m cuflash bench --mode memory --mem-seqlens 1024 4096 16384 --out $R
step features 100 python3 -m cuflash bench --mode features --out $R
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
