#!/usr/bin/env bash
# session 21 final call A, at the merged main, on a 4-GPU host: precompiles, GPU tests spread over the 4 GPUs
# (core heuristic grid fwd / bwd, every merged branch's tests: drp6, cap8, win3, dec11), sanitizers.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
# phase 1: precompiles in parallel (one shared cache)
bg pre_core 110 python3 tests/gpu_precompile.py --no-space --processes 12
bg pre_drop 110 python3 tests/drop6_precompile.py
bg pre_win 110 python3 tests/window_overlap_precompile.py
bg pre_cap 110 python3 tests/softcap_fixed_timing.py --precompile --tests --kvariants ''
bg pre_dec 110 python3 tests/decode_precompile.py --only stream_tests --processes 6
wait; echo "phase1 done $(el)s" >> $L/steps.log
# phase 2: GPU tests, one group per GPU (two groups share GPU 2 and 3)
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30"
CUDA_VISIBLE_DEVICES=0 bg t_core_fwd 200 $PT tests/test_flash_fwd_gpu.py -k "not every_point"
CUDA_VISIBLE_DEVICES=1 bg t_core_bwd 200 $PT tests/test_flash_bwd_gpu.py -k "not every_point"
CUDA_VISIBLE_DEVICES=2 bg t_drop 200 $PT tests/test_sm90_bwd_drop_packed_gpu.py \
  "tests/test_sm90_dropout_gpu.py::test_forward_and_backward_of_different_families_share_the_mask" \
  "tests/test_sm90_bwd_d64_gpu.py::test_odd_seqlens_dq_writer" \
  "tests/test_dropout_gpu.py::test_dropout_forward_backward_against_reference"
CUDA_VISIBLE_DEVICES=2 CUFLASH_SOFTCAP_SEEDS=8 bg t_cap 200 $PT tests/test_softcap_fixed_max_gpu.py tests/test_softcap_seeds_gpu.py
CUDA_VISIBLE_DEVICES=3 bg t_win 200 $PT tests/test_window_overlap_gpu.py tests/test_feature_defaults_gpu.py \
  "tests/test_sm90_bwd_features_gpu.py::test_window" tests/test_window_gpu.py
CUDA_VISIBLE_DEVICES=3 bg t_dec 200 $PT tests/test_decode_stream_gpu.py tests/test_decode_fused_gpu.py tests/test_decode_gpu.py
CUDA_VISIBLE_DEVICES=0 bg t_feat 200 $PT tests/test_features_gpu.py tests/test_feat4_gpu.py -k "softcap or window or dropout"
wait; echo "phase2 done $(el)s" >> $L/steps.log
# phase 3: sanitizers, spread over the GPUs
CS="compute-sanitizer --error-exitcode 1"
CUDA_VISIBLE_DEVICES=0 bg s_memcheck 150 $CS --tool memcheck python3 tests/gpu_sanitize.py --quick
CUDA_VISIBLE_DEVICES=1 bg s_race_win 150 $CS --tool racecheck python3 tests/window_overlap_sanitize.py
CUDA_VISIBLE_DEVICES=1 bg s_sync_win 150 $CS --tool synccheck python3 tests/window_overlap_sanitize.py
CUDA_VISIBLE_DEVICES=2 bg s_race_drop 150 $CS --tool racecheck python3 tests/drop6_sanitize.py
CUDA_VISIBLE_DEVICES=2 bg s_sync_drop 150 $CS --tool synccheck python3 tests/drop6_sanitize.py
CUDA_VISIBLE_DEVICES=3 bg s_mem_cap 150 $CS --tool memcheck python3 tests/softcap_fixed_sanitize.py
CUDA_VISIBLE_DEVICES=3 bg s_race_dec 150 $CS --tool racecheck python3 tests/decode_stream_sanitize.py
CUDA_VISIBLE_DEVICES=2 bg s_sync_sm90 150 $CS --tool synccheck python3 tests/gpu_sanitize.py --quick --families sm90_fwd sm90_bwd
wait; echo "phase3 done $(el)s" >> $L/steps.log
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs && rm -rf logs
