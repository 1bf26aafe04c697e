#!/usr/bin/env bash
# session 22 final call A, at the merged main (fwd14, cap9, dec12), on a 2-GPU host: precompiles, the merged
# branches' GPU tests over the 2 GPUs, sanitizers of the new defaults.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30"
bg pre_dec 100 python3 tests/decode_precompile.py --only regs_tests,core_tests --processes 8
bg pre_cap 100 python3 tests/softcap_fixed_timing.py --precompile --tests --kvariants ''
wait; echo "phase1 done $(el)s" >> $L/steps.log
# phase 2: GPU tests, one group per GPU
( export CUDA_VISIBLE_DEVICES=0
  step t_dec_regs 120 $PT tests/test_decode_regs_gpu.py
  step t_dec 90 $PT tests/test_decode_gpu.py
  CUFLASH_SOFTCAP_SEEDS=8 step t_cap 90 $PT tests/test_softcap_fixed_max_gpu.py tests/test_softcap_seeds_gpu.py
  step t_feat_cap 90 $PT tests/test_features_gpu.py -k softcap ) &
( export CUDA_VISIBLE_DEVICES=1
  CUDA_LAUNCH_BLOCKING=1 step t_levers 100 $PT tests/test_sm90_fwd_levers_gpu.py -k "lazy or even_waves or prefetch"
  step t_varlen_feat 120 python3 tests/sm90_varlen_bwd_switches.py --parallel 15 -- tests/test_varlen_features_gpu.py
  step t_varlen_bwd 120 $PT tests/test_sm90_varlen_gpu.py -k backward
  step t_drop_early 90 $PT tests/test_drop_early_gpu.py -k bit_for_bit
  step t_grid_d256 120 $PT tests/test_flash_fwd_gpu.py -k "sm90_fwd and d256 and not every_point" ) &
wait; echo "phase2 done $(el)s" >> $L/steps.log
# phase 3: sanitizers
CS="compute-sanitizer --error-exitcode 1"
CUDA_VISIBLE_DEVICES=0 bg s_race_dec 90 $CS --tool racecheck python3 tests/decode_regs_sanitize.py
CUDA_VISIBLE_DEVICES=0 bg s_mem_dec 90 $CS --tool memcheck python3 tests/decode_regs_sanitize.py
CUDA_VISIBLE_DEVICES=1 bg s_mem_cap 90 $CS --tool memcheck python3 tests/softcap_fixed_sanitize.py --bwd
CUDA_VISIBLE_DEVICES=1 bg s_sync_cap 90 $CS --tool synccheck python3 tests/softcap_fixed_sanitize.py
CUDA_VISIBLE_DEVICES=0 bg s_mem_sm90 120 $CS --tool memcheck python3 tests/gpu_sanitize.py --quick --families sm90_fwd
wait; echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs && rm -rf logs
