#!/usr/bin/env bash
# session 18 round 1, lead slot: does the sm90_bwd tune's table (non-dynamic winners, +5..38% in the
# tuner's bench-style timing) beat the heuristic in the bench itself? Same call, bench fwdbwd twice
# (each next to SDPA flash / cuDNN in its own process): shipped table vs CUFLASH_TUNED_DIR = the tune's.
set -u
R=/tmp/lead_r1; mkdir -p $R
X=results/NVIDIA_H100_80GB_HBM3/logs/session18_rounds
timeout 80 python3 -m cuflash bench --mode fwdbwd --dtypes bf16 --hdims 64 128 --seqlens 2048 8192 --out $R/base
CUFLASH_TUNED_DIR=$PWD/$X/t/tables_bwd_only timeout 80 python3 -m cuflash bench --mode fwdbwd --dtypes bf16 --hdims 64 128 --seqlens 2048 8192 --out $R/tuned
for f in $(find $R -name "*.json"); do cp $f /tmp/lead_$(basename $(dirname $f))_$(basename $f); done
