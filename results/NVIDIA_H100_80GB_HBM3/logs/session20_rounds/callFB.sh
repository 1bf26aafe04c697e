#!/usr/bin/env bash
# session 20 final call B, at the merged main: bench fwdbwd bf16 + fp16 (sm90_bwd's wide_epi in the heuristic),
# bench decode (the dynamic claims), the fixed 1 x 64k heuristic test
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
R=$OUT/res; mkdir -p $R
step t_dec64k 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_ringfill_gpu.py -k "heuristic_dynamic_1x64k"
step fwdbwd 160 python3 -m cuflash bench --mode fwdbwd --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R
step fwdbwd_fp16 160 python3 -m cuflash bench --mode fwdbwd --dtypes fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R/fp16
step decode 90 python3 -m cuflash bench --mode decode --out $R
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
