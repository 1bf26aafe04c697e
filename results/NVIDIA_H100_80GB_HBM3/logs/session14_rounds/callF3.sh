#!/usr/bin/env bash
# session 14 round F3 at the final main (+bwd256): sm90_bwd's GPU tests and sanitizers after the merge, d256 timing, bench fwdbwd
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt
R=$OUT/res; mkdir -p $R
bg() { local name=$1 t=$2; shift 2; ( timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log ) & }
step() { local name=$1 t=$2; shift 2; timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log; }
bg pre_d256 150 python3 tests/test_sm90_bwd_d256_gpu.py --precompile
bg pre_bwdc 150 python3 tests/sm90_bwd_causal_precompile.py
bg pre_core 150 python3 tests/gpu_precompile.py --no-space --processes 8
wait; echo "phase1 done $(el)s" >> $L/steps.log
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30"
CS="compute-sanitizer --error-exitcode 1"
bg t_bwd 200 $PT tests/test_sm90_bwd_d256_gpu.py tests/test_sm90_bwd_causal_gpu.py tests/test_sm90_bwd_gpu.py -k "not every_point"
bg t_core_bwd 200 $PT tests/test_flash_bwd_gpu.py -k "not every_point"
bg s_memcheck 200 $CS --tool memcheck python3 tests/gpu_sanitize.py --families sm90_bwd fa2_bwd
bg s_memcheck_extra 150 $CS --tool memcheck python3 san_extra.py
bg s_race_bwd 200 $CS --tool racecheck python3 tests/gpu_sanitize.py --quick --families sm90_bwd
bg s_race_extra 200 $CS --tool racecheck python3 san_extra.py
bg s_sync 200 $CS --tool synccheck python3 tests/gpu_sanitize.py --families sm90_bwd
wait; echo "phase2 done $(el)s" >> $L/steps.log
step bwd_d256 60 python3 tests/sm90_bwd_d256_timing.py --hdims 192 256 --seqlens 2048 4096 8192 16384 --reps 5 --out $R/sm90_bwd_d256_timing.json
step fwdbwd 150 python3 -m cuflash bench --mode fwdbwd --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res
