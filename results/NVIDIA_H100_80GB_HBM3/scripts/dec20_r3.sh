#!/usr/bin/env bash
# session 28 dec20 round 3 (the lead's round 3): the batch-1 rule with kSpec on (REGS_BATCH1_RULES <= 8k keys:
# regs_order 2, regs_spec 1): (a) decode_b1_timing 1 x 8k / 4k / 16k / 32k against the session-27 entry and, above
# 8k, kSpec on the interleaved rule; (b) the shipped rule's GPU tests; (c) memcheck, racecheck, synccheck of the
# shipped kSpec config; (d) bench --mode decode --decode-batches 1 at 8k; (e) paged against contiguous at 1 x 8k;
# (f) the eager call's host time.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
vs=(--variant "old regs_order=0 regs_spec=0" --variant "spec regs_order=2 regs_spec=1")
bg pre_t 16 python3 tests/decode_b1_timing.py --precompile --processes 6 --cells 1x8k 1x4k 1x16k 1x32k "${vs[@]}"
bg pre_s 16 python3 tests/decode_precompile.py --only spec_tests,shipped_b1 --processes 6
bg pre_p 16 python3 tests/decode_paged_timing.py --precompile --processes 4 --cells 1x8k
wait
step b1 15 python3 tests/decode_b1_timing.py --no-precompile --cells 1x8k 1x4k 1x16k 1x32k --reps 7 --repeat 9 \
  --max-seconds 12 --out $L/b1.json "${vs[@]}"
step tests 12 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode_staged_gpu.py tests/test_decode_spec_gpu.py \
  -k "test_batch1_rule and splits0 or batch1_rule_cuda_graph or spec_cuda_graph"
step memcheck 9 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/decode_spec_sanitize.py --b1
step racecheck 10 compute-sanitizer --tool racecheck --error-exitcode 9 python3 tests/decode_spec_sanitize.py --b1
step synccheck 8 compute-sanitizer --tool synccheck --error-exitcode 9 python3 tests/decode_spec_sanitize.py --b1
step bench 8 python3 -m cuflash bench --mode decode --decode-batches 1 --decode-ctxs 8192 --out $OUT/bench
step paged 8 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 --out $L/paged.json
step host 5 python3 tests/decode_host_timing.py --calls 200 --repeat 1 --out $L/host.json
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv >> $L/gpu.txt 2>&1
echo "all done $(el)s" >> $L/steps.log
