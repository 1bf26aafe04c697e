#!/usr/bin/env bash
# session 19 final call, command 3: the F1 failures' fixes (CuPy backward fast path, torch.compile with the
# dtype cache, the softcap default), the CuPy backward's host time, a second sample of the bf16 backward cells
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
R=$OUT/res; mkdir -p $R
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30"
step t_fix 120 $PT tests/test_cupy_bwd_fastpath_gpu.py tests/test_feature_defaults_gpu.py tests/test_flash_fwd_gpu.py tests/test_flash_bwd_gpu.py -k "fastpath or repeat or differing or defaults or compile or graph or plan"
step prof 40 python3 results/NVIDIA_H100_80GB_HBM3/scripts/cupy_bwd_host_profile.py
step overhead 45 python3 -m cuflash bench --mode overhead --out $R
step fwdbwd_b 60 python3 -m cuflash bench --mode fwdbwd --hdims 128 256 --seqlens 2048 8192 --out $R
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
