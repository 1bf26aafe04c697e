#!/bin/bash
# session 31 win5 round 5: the branch as it will merge (dq_tail 2 on for the bf16 d128 window backward): the two
# timing processes again (the features timing with bwd_dqt0 = without it; the per-kernel timing with dqt0), and
# the whole dq_tail GPU test file.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre 30 python3 tests/dq_tail_precompile.py --tests
step feat 24 python3 tests/features_overhead_timing.py --quick --mask both --features window --fwd-heuristic --bwd-pass --out $L/feat.json
step bwdk 22 python3 tests/window_bwd_kernels_timing.py --variants heuristic,dqt,dqt0 --no-precompile --out $L/bwdk.json
step test 16 python3 -m pytest -q tests/test_bwd_dq_tail_gpu.py
