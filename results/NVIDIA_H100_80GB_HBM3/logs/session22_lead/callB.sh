#!/usr/bin/env bash
# session 22 final call B, at the merged main, on one H100: bench decode (decode_splitkv_regs the default),
# bench fwd bf16 + fp16 (lazy rescale at d256), bench features (softcap's raised fixed max, wide_epi).
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
R=$OUT/res; mkdir -p $R
step decode 110 python3 -m cuflash bench --mode decode --out $R
step fwd 120 python3 -m cuflash bench --mode fwd --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R
step fwd_fp16 130 python3 -m cuflash bench --mode fwd --dtypes fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R/fp16
step features 170 python3 -m cuflash bench --mode features --out $R
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
