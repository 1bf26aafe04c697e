#!/usr/bin/env bash
# session 18 final round F3 (device budget left: ~260 s): the feature GPU tests after the kRoundedL fix,
# then bench fwdbwd bf16 (the dq_first / feature-schedule defaults in the bench)
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
R=$OUT/res; mkdir -p $R
python3 tests/softcap_fixed_timing.py --precompile --tests --kvariants "" > $L/pre_cap.log 2>&1 &
timeout 50 python3 tests/gpu_precompile.py --no-space --processes 8 > $L/pre_core.log 2>&1 &
wait
step t_feat 85 python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30 tests/test_softcap_fixed_max_gpu.py tests/test_sm90_bwd_features_gpu.py tests/test_feature_defaults_gpu.py
step fwdbwd 110 python3 -m cuflash bench --mode fwdbwd --dtypes bf16 --hdims 64 128 256 --seqlens 2048 8192 16384 --out $R
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res
