#!/usr/bin/env bash
# session 15 final round F1 at the merged main: precompile, GPU tests (core heuristic grid + every helper's new tests), sanitizers
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
X=results/NVIDIA_H100_80GB_HBM3/logs/session15_rounds
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt 2>/dev/null
bg() { local name=$1 t=$2; shift 2; ( timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log ) & }
# phase 1: precompiles in parallel
bg pre_core 150 python3 tests/gpu_precompile.py --no-space --processes 6
bg pre_d128 150 python3 tests/sm90_bwd_d128_precompile.py --d64
bg pre_d256b 150 python3 tests/test_sm90_bwd_d256_gpu.py --precompile
bg pre_d256 150 python3 tests/sm90_bwd_d256_timing.py --precompile-only --with-tests --dtypes bf16 fp16 --hdims 192 256 --no-fa2 --sdpa cudnn
bg pre_nc 150 python3 tests/sm90_fwd_nc_timing.py --precompile-only --with-tests
bg pre_feat 150 python3 tests/features_overhead_timing.py --precompile --quick --mask both
bg pre_dec 150 python3 tests/decode_precompile.py --only latency_tests,tma_tests,sanitize,timing --processes 4
wait; echo "phase1 done $(el)s" >> $L/steps.log
# phase 2: GPU tests in parallel groups
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30"
bg t_core 220 $PT tests/test_flash_fwd_gpu.py tests/test_flash_bwd_gpu.py -k "not every_point"
bg t_bwd 220 $PT tests/test_sm90_bwd_d128_gpu.py tests/test_sm90_bwd_causal_gpu.py tests/test_sm90_bwd_gpu.py -k "not every_point"
bg t_d256 220 $PT tests/test_sm90_bwd_d256_dqw_gpu.py tests/test_sm90_bwd_d256_gpu.py
bg t_fwd 220 $PT tests/test_sm90_fwdnc_gpu.py tests/test_feature_defaults_gpu.py tests/test_alibi_linear_gpu.py tests/test_feature_candidates_gpu.py tests/test_features_opt_gpu.py tests/test_sm90_sched_gpu.py
bg t_dec 220 $PT tests/test_decode_latency_gpu.py tests/test_decode_fused_gpu.py tests/test_decode_tma_gpu.py tests/test_decode_gpu.py -k "not long_context"
wait; echo "phase2 done $(el)s" >> $L/steps.log
# phase 3: sanitizers in parallel
CS="compute-sanitizer --error-exitcode 1"
bg s_memcheck 170 $CS --tool memcheck python3 tests/gpu_sanitize.py
bg s_memcheck_extra 150 $CS --tool memcheck python3 $X/san_extra15.py
bg s_race_sm90_fwd 150 $CS --tool racecheck python3 tests/gpu_sanitize.py --quick --families sm90_fwd
bg s_race_sm90_bwd 150 $CS --tool racecheck python3 tests/gpu_sanitize.py --quick --families sm90_bwd
bg s_race_decode 150 $CS --tool racecheck python3 tests/gpu_sanitize.py --quick --families decode_splitkv
bg s_race_extra 170 $CS --tool racecheck python3 $X/san_extra15.py
bg s_sync 170 $CS --tool synccheck python3 tests/gpu_sanitize.py --families sm90_fwd sm90_bwd
wait; echo "phase3 done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs
