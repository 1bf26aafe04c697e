#!/usr/bin/env bash
# session 14 round F2a at merged main (+feat2, decode fix): feat2's GPU tests, full memcheck again, racecheck with features, helpers' timing
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt
R=$OUT/res; mkdir -p $R
P1="L2_PREFETCH_DEFAULT=256"; P2="SMALL_PAGE_WARPS=4 PAGED_SPLIT_RULE_RESIDENT=true"
bg() { local name=$1 t=$2; shift 2; ( timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log ) & }
step() { local name=$1 t=$2; shift 2; timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log; }
bg pre_feat 150 python3 tests/features_overhead_timing.py --precompile
bg pre_d64 150 python3 tests/sm90_fwd_d64_precompile.py --dtype bf16,fp16 --rows heur
bg pre_bwdc 150 python3 tests/sm90_bwd_causal_precompile.py
bg pre_dec 150 python3 tests/decode_precompile.py --processes 8 --propose "$P1" --propose "$P2"
bg pre_core 150 python3 tests/gpu_precompile.py --no-space --processes 8
wait; echo "phase1 done $(el)s" >> $L/steps.log
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30"
CS="compute-sanitizer --error-exitcode 1"
bg t_feat 200 $PT tests/test_features_opt_gpu.py tests/test_features_gpu.py tests/test_sm90_softcap_gpu.py
bg s_memcheck 200 $CS --tool memcheck python3 tests/gpu_sanitize.py
bg s_race_feat 200 $CS --tool racecheck python3 tests/gpu_sanitize.py --features --families sm90_fwd sm90_bwd
wait; echo "phase2 done $(el)s" >> $L/steps.log
step feat_timing 130 python3 tests/features_overhead_timing.py --out $R/features_overhead_timing.json
step d64_fp16 60 python3 tests/sm90_fwd_d64_timing.py --dtype bf16,fp16 --rows heur --reps 8 --out $R/d64_timing_final.json
step dec_prop 70 python3 tests/decode_tma_timing.py --no-precompile --repeat 3 --profile --propose "$P1" --propose "$P2" --max-seconds 35 --out $R/decode_tma_timing.json
step bwdc_timing 60 python3 tests/sm90_bwd_causal_timing.py --no-flash --variants heur plain dyn dyn_ds2 --out $R/sm90_bwd_causal_timing_final.json
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res
