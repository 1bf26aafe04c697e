#!/bin/bash
# session 31 win5 round 2: dq_tail (one barrier a job, the ticket's round trip hidden, two CTAs an SM): the per-kernel
# breakdown and wall time against the shipped window backward and the plain call (bf16 d128 2 x 16 x 8k, one H200),
# its GPU tests, memcheck of its small cases.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre 45 python3 tests/dq_tail_precompile.py --tests
step test 22 python3 -m pytest -q -x tests/test_bwd_dq_tail_gpu.py
step bwdk 35 python3 tests/window_bwd_kernels_timing.py --variants heuristic,dqt --no-precompile --out $L/bwdk.json
step memcheck 25 compute-sanitizer --tool memcheck python3 tests/dq_tail_sanitize.py --quick
