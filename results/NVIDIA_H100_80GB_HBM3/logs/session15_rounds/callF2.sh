#!/usr/bin/env bash
# session 15 final round F2 at the merged main: bench fwd (bf16) / fwdbwd / decode / overhead, features timing (shipped defaults)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt
R=$OUT/res; mkdir -p $R
step() { local name=$1 t=$2; shift 2; timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log; }
bg() { local name=$1 t=$2; shift 2; ( timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log ) & }
X=results/NVIDIA_H100_80GB_HBM3/logs/session15_rounds
CS="compute-sanitizer --error-exitcode 1"
bg s_race_sm90_bwd 100 $CS --tool racecheck python3 tests/gpu_sanitize.py --quick --families sm90_bwd
bg s_race_extra 120 $CS --tool racecheck python3 $X/san_extra15.py
bg pre_bench 150 python3 $X/pre_bench.py
bg pre_dec 150 python3 tests/decode_precompile.py --only timing --processes 4
bg t_dec_fix 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_tma_gpu.py -k tma_refusals
wait; echo "recheck done $(el)s" >> $L/steps.log
step fwdbwd 160 python3 -m cuflash bench --mode fwdbwd --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R
step fwd 110 python3 -m cuflash bench --mode fwd --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R
step decode 60 python3 -m cuflash bench --mode decode --out $R
step overhead 40 python3 -m cuflash bench --mode overhead --out $R
step features 80 python3 tests/features_overhead_timing.py --heuristic-only --mask both --reps 10 --out $R/features_overhead_final.json
step fwd_fp16 110 python3 -m cuflash bench --mode fwd --dtypes fp16 --hdims 64 128 256 --seqlens 2048 4096 8192 16384 --out $R/fp16
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res
