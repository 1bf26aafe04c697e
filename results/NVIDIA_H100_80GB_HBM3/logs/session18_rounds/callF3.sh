#!/usr/bin/env bash
# session 18 final round F3 (device budget left: ~260 s): the feature GPU tests after the kRoundedL fix,
# then bench fwdbwd bf16 (the dq_first / feature-schedule defaults in the bench)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt
R=$OUT/res; mkdir -p $R
step() { local name=$1 t=$2; shift 2; timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log; }
python3 tests/softcap_fixed_timing.py --precompile --tests --kvariants "" > $L/pre_cap.log 2>&1 &
timeout 50 python3 tests/gpu_precompile.py --no-space --processes 8 > $L/pre_core.log 2>&1 &
wait
step t_feat 85 python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30 tests/test_softcap_fixed_max_gpu.py tests/test_sm90_bwd_features_gpu.py tests/test_feature_defaults_gpu.py
step fwdbwd 110 python3 -m cuflash bench --mode fwdbwd --dtypes bf16 --hdims 64 128 256 --seqlens 2048 8192 16384 --out $R
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res
