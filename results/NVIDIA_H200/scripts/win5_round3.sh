#!/bin/bash
# session 31 win5 round 3: dq_tail on for the full window (WINDOW_DQ_TAIL): the features timing (forward,
# forward + backward, backward alone x visible; bwd_dqt0 = without it), compute-sanitizer memcheck / racecheck /
# synccheck of the dq_tail kernels (two small cases each), then the per-kernel timing (a second process).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre 30 python3 tests/dq_tail_precompile.py --tests
step feat 22 python3 tests/features_overhead_timing.py --quick --mask both --features window --fwd-heuristic --bwd-pass --out $L/feat.json
step memcheck 15 compute-sanitizer --tool memcheck python3 tests/dq_tail_sanitize.py --quick
step racecheck 15 compute-sanitizer --tool racecheck python3 tests/dq_tail_sanitize.py --quick
step synccheck 15 compute-sanitizer --tool synccheck python3 tests/dq_tail_sanitize.py --quick
step bwdk 25 python3 tests/window_bwd_kernels_timing.py --variants heuristic,dqt,dqt2,dqt0 --no-precompile --out $L/bwdk.json
