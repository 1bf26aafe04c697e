#!/bin/bash
# session 31 win5 round 3: dq_tail on for the full window (WINDOW_DQ_TAIL): two timing processes, the features
# timing (forward, forward + backward, backward alone x visible; bwd_dqt0 = without it) and the per-kernel timing
# (dqt0 = without it), then compute-sanitizer memcheck of the dq_tail kernels (two small cases).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre 30 python3 tests/dq_tail_precompile.py --tests
step feat 22 python3 tests/features_overhead_timing.py --quick --mask both --features window --fwd-heuristic --bwd-pass --out $L/feat.json
step bwdk 22 python3 tests/window_bwd_kernels_timing.py --variants heuristic,dqt,dqt2,dqt0 --no-precompile --out $L/bwdk.json
step memcheck 20 compute-sanitizer --tool memcheck python3 tests/dq_tail_sanitize.py --quick
