#!/usr/bin/env bash
# session 16 last call G at the merged main (with the roles synccheck fix): synccheck / racecheck / GPU tests of
# the d256 roles kernel, synccheck of sm90_fwd/sm90_bwd, bench fwdbwd d256 (bf16; F2a ran out of time there),
# fp16 benches, start-up
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt
R=$OUT/res; mkdir -p $R
step() { local name=$1 t=$2; shift 2; timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log; }
bg() { local name=$1 t=$2; shift 2; ( timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log ) & }
CS="compute-sanitizer --error-exitcode 1"
( export CUFLASH_LINEINFO=1 CUPY_CACHE_DIR=/tmp/cupy_li; python3 tests/sm90_bwd_d256_race.py --precompile --only _rol > $L/pre_li.log 2>&1
  bg s_sync_rol 60 $CS --tool synccheck python3 tests/sm90_bwd_d256_race.py --only _rol
  bg s_race_rol 90 $CS --tool racecheck --racecheck-report all python3 tests/sm90_bwd_d256_race.py --only _rol; wait ) &
bg pre_rol 90 python3 tests/test_sm90_bwd_d256_roles_gpu.py --precompile
wait
bg t_rol 90 python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_sm90_bwd_d256_roles_gpu.py
bg s_sync 120 $CS --tool synccheck python3 tests/gpu_sanitize.py --families sm90_fwd sm90_bwd
wait; echo "checks done $(el)s" >> $L/steps.log
step fwdbwd256 90 python3 -m cuflash bench --mode fwdbwd --hdims 256 --seqlens 2048 4096 8192 16384 --out $R/d256
step fwdbwd_fp16 170 python3 -m cuflash bench --mode fwdbwd --dtypes fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R/fp16
step fwd_fp16 80 python3 -m cuflash bench --mode fwd --dtypes fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R/fp16
step startup 100 python3 -m cuflash bench --mode startup --out $R
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res
