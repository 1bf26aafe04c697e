#!/usr/bin/env bash
# session 19 call F4: the CuPy fast-path test with the shared conftest fixture; the eager fwd+bwd probe
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step t_fast 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cupy_bwd_fastpath_gpu.py tests/test_flash_fwd_gpu.py -k "fastpath or repeat or differing or validated or plan"
step eager 60 python3 results/NVIDIA_H100_80GB_HBM3/scripts/eager_sync_probe.py
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs && rm -rf logs
