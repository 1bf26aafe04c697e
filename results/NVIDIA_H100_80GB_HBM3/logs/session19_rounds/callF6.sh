#!/usr/bin/env bash
# session 19 call F6: after the review refactor (the CuPy backward's plan kept inside _backward_cupy; the
# eager scripts sharing their calls): the fast-path and plan tests, the CuPy backward's host time, the probe
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step t_fast 70 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cupy_bwd_fastpath_gpu.py tests/test_flash_fwd_gpu.py tests/test_flash_bwd_gpu.py -k "fastpath or repeat or differing or validated or plan or cupy"
step prof 30 python3 results/NVIDIA_H100_80GB_HBM3/scripts/cupy_bwd_host_profile.py
step eager 40 python3 results/NVIDIA_H100_80GB_HBM3/scripts/eager_sync_probe.py
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs && rm -rf logs
