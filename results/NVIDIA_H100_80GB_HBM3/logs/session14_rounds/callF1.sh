#!/usr/bin/env bash
# session 14 final round F1 at the merged main: precompile, GPU tests (core heuristic grid + every helper's new tests), sanitizers
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt 2>/dev/null
FEAT=${FEAT:-1}
P1="L2_PREFETCH_DEFAULT=256"; P2="SMALL_PAGE_WARPS=4 PAGED_SPLIT_RULE_RESIDENT=true"
bg() { local name=$1 t=$2; shift 2; ( timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log ) & }
# phase 1: every precompile in parallel
bg pre_core 150 python3 tests/gpu_precompile.py --no-space --processes 8
bg pre_drop3 150 python3 tests/drop3_precompile.py
bg pre_bwdc 150 python3 tests/sm90_bwd_causal_precompile.py
bg pre_d256 150 python3 tests/test_sm90_bwd_d256_gpu.py --precompile
bg pre_d64 150 python3 tests/sm90_fwd_d64_precompile.py --dtype bf16,fp16 --rows heur
bg pre_dec 150 python3 tests/decode_precompile.py --processes 8 --propose "$P1" --propose "$P2"
[ "$FEAT" = 1 ] && bg pre_feat 150 python3 tests/features_overhead_timing.py --precompile --tests-only
wait; echo "phase1 done $(el)s" >> $L/steps.log
# phase 2: GPU tests, four groups in parallel
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30"
FT=""; [ "$FEAT" = 1 ] && FT=tests/test_features_opt_gpu.py
bg t_core 210 $PT tests/test_flash_fwd_gpu.py tests/test_flash_bwd_gpu.py -k "not every_point"
bg t_bwd 210 $PT tests/test_sm90_bwd_causal_gpu.py tests/test_sm90_bwd_d256_gpu.py tests/test_sm90_bwd_gpu.py -k "not every_point"
bg t_fwd 210 $PT tests/test_sm90_dropout_gpu.py tests/test_sm90_psmem_gpu.py tests/test_sm90_sched_gpu.py $FT
bg t_dec 210 $PT tests/test_decode_tma_gpu.py tests/test_decode_bandwidth_gpu.py tests/test_decode_gpu.py -k "not long_context"
wait; echo "phase2 done $(el)s" >> $L/steps.log
# phase 3: sanitizers in parallel
CS="compute-sanitizer --error-exitcode 1"
bg s_memcheck 170 $CS --tool memcheck python3 tests/gpu_sanitize.py
bg s_memcheck_extra 120 $CS --tool memcheck python3 san_extra.py
bg s_race_sm90_fwd 120 $CS --tool racecheck python3 tests/gpu_sanitize.py --quick --families sm90_fwd
bg s_race_sm90_bwd 120 $CS --tool racecheck python3 tests/gpu_sanitize.py --quick --families sm90_bwd
bg s_race_decode 120 $CS --tool racecheck python3 tests/gpu_sanitize.py --quick --families decode_splitkv
bg s_race_extra 150 $CS --tool racecheck python3 san_extra.py
bg s_sync 150 $CS --tool synccheck python3 tests/gpu_sanitize.py --families sm90_fwd sm90_bwd
wait; echo "phase3 done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs
