#!/bin/bash
# session 31 win5 round 4: dq_tail form 2 on for the window backward (both masks): compute-sanitizer memcheck /
# racecheck / synccheck of its kernels (two small cases each), the plain calls' dq_tail GPU tests, and the
# shipped defaults' window forward + backward tests (the backward now with dq_tail), then a timing process.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre 30 python3 tests/dq_tail_precompile.py --tests --defaults
step racecheck 18 compute-sanitizer --tool racecheck python3 tests/dq_tail_sanitize.py --quick
step synccheck 14 compute-sanitizer --tool synccheck python3 tests/dq_tail_sanitize.py --quick
step memcheck 12 compute-sanitizer --tool memcheck python3 tests/dq_tail_sanitize.py --quick
step defaults 14 python3 -m pytest -q tests/test_feature_defaults_gpu.py -k "switched or win_full or (win_causal and not s3)"
step test 12 python3 -m pytest -q tests/test_bwd_dq_tail_gpu.py -k plain
