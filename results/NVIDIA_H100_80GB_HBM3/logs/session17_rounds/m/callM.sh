#!/usr/bin/env bash
# session 17: feat5 merged with main: its GPU tests, the feature defaults, dq_convert + d128 bwd tests (template tail changed), feature timing
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt
step() { local name=$1 t=$2; shift 2; timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log; }
bgs() { local name=$1 t=$2; shift 2; ( timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log ) & }
bgs pre_feat 120 python3 tests/features_overhead_timing.py --precompile --mask both --heuristic-only --features softcap,alibi,window --gpu-tests
bgs pre_dqc 120 python3 tests/sm90_bwd_dqconv_precompile.py
wait
PT="python3 -m pytest -m gpu -q -p no:cacheprovider"
step t_feat 150 $PT tests/test_bwd_feature_sched_gpu.py tests/test_feature_defaults_gpu.py tests/test_sm90_bwd_dqconv_gpu.py
step t_featsm90 120 $PT tests/test_sm90_bwd_features_gpu.py tests/test_features_gpu.py -k "softcap or alibi or window"
step race 100 compute-sanitizer --error-exitcode 1 --tool racecheck python3 results_san.py
step timing 120 python3 tests/features_overhead_timing.py --mask both --heuristic-only --features softcap,alibi,window --bwd-pass --reps 5
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs
