#!/usr/bin/env bash
# session 27 dec18 round 1: (a) graph timing at 1 x 8k / 4k of the regs kernel in cuDNN's grid shape
# (4 warps, 32 splits, two CTAs per SM; fused or separate combine) next to the default, SDPA flash and
# cuDNN; (b) ncu --set full with source correlation (lineinfo) of the default, the 4-warp 32-split
# kernel (+ decode_combine) and cuDNN's two kernels at 1 x 8k, warm L2, exported as text/csv.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
export CUFLASH_LINEINFO=1     # -lineinfo: ncu's source view; the same SASS
v1="w4s32 warps=4 splits=32 fused_combine=0 light_fence=0"
v2="w4s32fc warps=4 splits=32"
v3="w4s16fc warps=4 splits=16"
v4="w2s64fc warps=2 splits=64"
v5="w8s16nf fused_combine=0 light_fence=0"
step pre 30 python3 tests/decode_b1_timing.py --precompile --processes 8 --cells 1x8k 1x4k \
  --variant "$v1" --variant "$v2" --variant "$v3" --variant "$v4" --variant "$v5"
step b1 45 python3 tests/decode_b1_timing.py --no-precompile --cells 1x8k 1x4k --reps 7 --repeat 7 --profile --out $L/b1.json \
  --variant "$v1" --variant "$v2" --variant "$v3" --variant "$v4" --variant "$v5"
tmp=$(mktemp -d)
step ncu 60 ncu --profile-from-start off --cache-control none --set full --import-source yes \
  --kernel-name regex:'decode_splitkv_regs|decode_combine|cudnn_generated|lean_reduction' -f -o $tmp/rep \
  python3 tests/decode_b1_timing.py --no-precompile --ncu --cells 1x8k --variant "$v1"
step ncu_det 15 ncu -i $tmp/rep.ncu-rep --page details --print-details all
step ncu_sass 15 ncu -i $tmp/rep.ncu-rep --page source --csv --print-source sass
step ncu_cuda 15 ncu -i $tmp/rep.ncu-rep --page source --csv --print-source cuda
step ncu_raw 15 ncu -i $tmp/rep.ncu-rep --page raw --csv
echo "all done $(el)s" >> $L/steps.log
