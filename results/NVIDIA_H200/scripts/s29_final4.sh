#!/usr/bin/env bash
# session 29, the lead's check of the shared precompile runner (tests/helper_precompile.py) on the GPU: the four
# helper precompile scripts, then the rotary / cross-entropy / dense_act GPU tests on the cache they filled.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
bg pre_ln 40 python3 tests/layer_norm_precompile.py --processes 6
bg pre_da 30 python3 tests/dense_act_precompile.py --processes 4
bg pre_ro 30 python3 tests/rotary_precompile.py --processes 3
bg pre_ce 30 python3 tests/cross_entropy_precompile.py --processes 3 --variants 512x2
wait
bg t_ro 40 python3 -m pytest -q -p no:cacheprovider -rf tests/test_rotary_gpu.py
bg t_ce 40 python3 -m pytest -q -p no:cacheprovider -rf tests/test_cross_entropy_gpu.py
wait
echo "all done $(el)s" >> $L/steps.log
