#!/usr/bin/env bash
# session 27 dec18 round 2: the staged ring (regs_staged) of decode_splitkv_regs. (a) graph timing, one process,
# next to the default, SDPA flash and cuDNN: 1 x 4k / 8k / 16k / 32k and 8 x 8k; (b) its GPU tests;
# (c) memcheck of the sanitizer script.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
v1="w4rst2 warps=4 regs_staged=2"
v2="w4rst2nf warps=4 regs_staged=2 fused_combine=0 light_fence=0"
v3="w4rst1 warps=4 regs_staged=1"
v4="w8rst2 regs_staged=2"
v5="w4s32 warps=4 splits=32"
bg pre_t 40 python3 tests/decode_b1_timing.py --precompile --processes 8 --cells 1x4k 1x8k 1x16k 1x32k 8x8k \
  --variant "$v1" --variant "$v2" --variant "$v3" --variant "$v4" --variant "$v5"
bg pre_s 40 python3 tests/decode_precompile.py --only staged_tests --processes 8
wait
step b1 40 python3 tests/decode_b1_timing.py --no-precompile --cells 1x8k 1x4k 1x16k 1x32k 8x8k --reps 7 --repeat 7 \
  --profile --out $L/b1.json --variant "$v1" --variant "$v2" --variant "$v3" --variant "$v4" --variant "$v5"
step tests 35 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode_staged_gpu.py
step memcheck 25 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/decode_staged_sanitize.py
echo "all done $(el)s" >> $L/steps.log
