#!/usr/bin/env bash
# session 27 dec18 round 3: the batch-1 rule as shipped (REGS_BATCH1_RULES <= 8k keys: separate combine, early
# partial-O loads, pdl 1) against the old default (fused merge) and its parts, one process per table:
# (a) decode_b1_timing at 1 x 8k / 4k; (b) bench --mode decode --decode-batches 1 (4k, 8k, 16k; pages 16 and 256);
# (c) the eager call's host time; (d) the rule's GPU tests; (e) memcheck, racecheck; (f) next to a projection GEMM.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
old="old fused_combine=1 light_fence=1 early_merge=0 pdl=0"
v1="nfpdl early_merge=0"
v2="nfem pdl=0"
v3="nfempdl2 pdl=2"
cells="1x8k 1x4k"
bg pre_t 25 python3 tests/decode_b1_timing.py --precompile --processes 8 --cells $cells 1x16k \
  --variant "$old" --variant "$v1" --variant "$v2" --variant "$v3"
bg pre_s 25 python3 tests/decode_precompile.py --only staged_tests --processes 8
wait
step b1 20 python3 tests/decode_b1_timing.py --no-precompile --cells $cells --reps 7 --repeat 9 --profile \
  --out $L/b1.json --variant "$old" --variant "$v1" --variant "$v2" --variant "$v3"
step bench 20 python3 -m cuflash bench --mode decode --decode-batches 1 --decode-ctxs 4096 8192 16384 --out $OUT/bench
step host 10 python3 tests/decode_host_timing.py --calls 500 --repeat 1 --out $L/host.json
step tests 14 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode_staged_gpu.py -k "batch1_rule"
step memcheck 6 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/decode_staged_sanitize.py --shipped
step racecheck 6 compute-sanitizer --tool racecheck --error-exitcode 9 python3 tests/decode_staged_sanitize.py --shipped
step nb 12 python3 tests/decode_pdl_neighbour_timing.py --cells 1x8k --neighbours alone proj --pdl 0 --repeat 3 \
  --variant "$old" --out $L/nb.json
echo "all done $(el)s" >> $L/steps.log
