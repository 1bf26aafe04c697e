#!/bin/bash
# session 31 win5 round 2: dq_tail forms 1 / 2 (2: the writer counts a tile behind the next one's first Q block):
# the per-kernel breakdown and wall time against the shipped window backward and the plain call (bf16 d128
# 2 x 16 x 8k, one H200), then its GPU tests (window).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre 50 python3 tests/dq_tail_precompile.py --tests
step bwdk 30 python3 tests/window_bwd_kernels_timing.py --variants heuristic,dqt,dqt2 --no-precompile --out $L/bwdk.json
step test 30 python3 -m pytest -q -x tests/test_bwd_dq_tail_gpu.py -k window
