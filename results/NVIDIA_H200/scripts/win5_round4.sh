#!/bin/bash
# session 31 win5 round 4: racecheck / synccheck of the dq_tail kernels (two small cases each), the plain calls'
# dq_tail GPU tests, and the shipped defaults' full-window forward + backward test (its backward now with dq_tail).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre 30 python3 tests/dq_tail_precompile.py --tests --defaults
step racecheck 20 compute-sanitizer --tool racecheck python3 tests/dq_tail_sanitize.py --quick
step synccheck 20 compute-sanitizer --tool synccheck python3 tests/dq_tail_sanitize.py --quick
step test 15 python3 -m pytest -q tests/test_bwd_dq_tail_gpu.py -k "plain"
step defaults 15 python3 -m pytest -q tests/test_feature_defaults_gpu.py -k "win_full or switched"
