#!/bin/bash
# session 31 win5 round 1: dq_tail (sm90_bwd's dQ convert as a programmatic dependent of the main kernel)
# against the shipped window backward and the plain call, bf16 d128 2 x 16 x 8k, one H200; its GPU tests.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre 50 python3 tests/dq_tail_precompile.py --tests
step bwdk 18 python3 tests/window_bwd_kernels_timing.py --variants heuristic,dqt --out $L/bwdk.json
step test 20 python3 -m pytest -q -x tests/test_bwd_dq_tail_gpu.py
step feat 22 python3 tests/features_overhead_timing.py --quick --mask both --features window --fwd-heuristic --bwd-pass --out $L/feat.json
