#!/usr/bin/env bash
# session 27 dec18 round 2: the staged ring (regs_staged) of decode_splitkv_regs. (a) graph timing, one process,
# next to the default, SDPA flash and cuDNN at 1 x 8k / 4k / 16k (8 warps x 16 splits and 4 warps x 32 splits,
# ring depth 1 / 2, fused and separate combine, the separate combine with pdl 1); (b) its GPU tests; (c) memcheck of its sanitizer script.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
v1="w8nf fused_combine=0 light_fence=0"
v2="w8rst2nf regs_staged=2 fused_combine=0 light_fence=0"
v3="w8rst1nf regs_staged=1 fused_combine=0 light_fence=0"
v4="w8rst2 regs_staged=2"
v5="w4rst2nf warps=4 regs_staged=2 fused_combine=0 light_fence=0"
v6="w4rst2 warps=4 regs_staged=2"
v7="w8nfpdl fused_combine=0 light_fence=0 pdl=1"
v8="w8rst2nfpdl regs_staged=2 fused_combine=0 light_fence=0 pdl=1"
cells="1x8k 1x4k 1x16k"
bg pre_t 40 python3 tests/decode_b1_timing.py --precompile --processes 8 --cells $cells \
  --variant "$v1" --variant "$v2" --variant "$v3" --variant "$v4" --variant "$v5" --variant "$v6" --variant "$v7" --variant "$v8"
bg pre_s 40 python3 tests/decode_precompile.py --only staged_tests --processes 8
wait
step b1 35 python3 tests/decode_b1_timing.py --no-precompile --cells $cells --reps 7 --repeat 7 --profile \
  --out $L/b1.json --variant "$v1" --variant "$v2" --variant "$v3" --variant "$v4" --variant "$v5" --variant "$v6" --variant "$v7" --variant "$v8"
step tests 35 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode_staged_gpu.py
step memcheck 20 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/decode_staged_sanitize.py
echo "all done $(el)s" >> $L/steps.log
