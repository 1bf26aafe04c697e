#!/usr/bin/env bash
# session 19 final call, command 1, at the merged main: precompile, GPU tests (core heuristic grid + every
# merged branch's tests), sanitizers (memcheck every family + the new default paths; racecheck; synccheck)
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
X=results/NVIDIA_H100_80GB_HBM3/logs/session19_rounds
# phase 1: precompiles in parallel
bg pre_core 110 python3 tests/gpu_precompile.py --no-space --processes 6
bg pre_d128 110 python3 tests/sm90_bwd_d128_precompile.py --no-tests --grid --d64 --rot
bg pre_fwd 110 python3 tests/sm90_fwd_cells_timing.py --dtype bf16,fp16 --with-tests --with-st-tests --order-check --precompile-only
bg pre_feat 110 python3 tests/bwd_feature_sched_precompile.py --no-timing
bg pre_dqf 110 python3 tests/sm90_bwd_dqfirst_precompile.py
bg pre_cap 110 python3 tests/softcap_fixed_timing.py --precompile --tests --kvariants ""
wait; echo "phase1 done $(el)s" >> $L/steps.log
# phase 2: GPU tests in parallel groups
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30"
bg t_core 200 $PT tests/test_flash_fwd_gpu.py tests/test_flash_bwd_gpu.py -k "not every_point"
bg t_bwd 200 $PT tests/test_sm90_bwd_d128_gpu.py tests/test_sm90_bwd_gpu.py tests/test_sm90_bwd_dqconv_gpu.py tests/test_sm90_bwd_dqfirst_gpu.py tests/test_sm90_bwd_d256_gpu.py -k "odd_seqlens or gqa_mqa or smaller_real or deterministic_bitwise or heuristic_is or many_tiles or s3_and_d64_rot or dqconv or dq_convert or dqfirst or dq_first or d256 or wide or plain"
bg t_feat 200 $PT tests/test_bwd_feature_sched_gpu.py tests/test_softcap_fixed_max_gpu.py tests/test_sm90_bwd_features_gpu.py tests/test_feature_defaults_gpu.py tests/test_softcap_seeds_gpu.py
bg t_feat2 200 $PT tests/test_feat4_gpu.py tests/test_feature_candidates_gpu.py tests/test_features_gpu.py -k softcap
bg t_fwd 200 $PT tests/test_fp8_gpu.py tests/test_sm90_fwdnc_gpu.py tests/test_sm90_stream_tail_gpu.py tests/test_sm90_d64_q2_gpu.py tests/test_cupy_bwd_fastpath_gpu.py tests/test_distributed_dqsum_gpu.py tests/test_decode_host_gpu.py
wait; echo "phase2 done $(el)s" >> $L/steps.log
# phase 3: sanitizers in parallel
CS="compute-sanitizer --error-exitcode 1"
bg s_memcheck 150 $CS --tool memcheck python3 tests/gpu_sanitize.py --quick
bg s_memcheck_extra 150 $CS --tool memcheck python3 $X/san_extra19.py
bg s_race_sm90 150 $CS --tool racecheck python3 tests/gpu_sanitize.py --quick --families sm90_fwd sm90_bwd
bg s_race_extra 150 $CS --tool racecheck python3 $X/san_extra19.py
bg s_race_dqf 150 $CS --tool racecheck python3 tests/sm90_bwd_dqfirst_sanitize.py --quick
bg s_sync 150 $CS --tool synccheck python3 tests/gpu_sanitize.py --quick --families sm90_fwd sm90_bwd sm90_fwd_fp8
wait; echo "phase3 done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs && rm -rf logs
