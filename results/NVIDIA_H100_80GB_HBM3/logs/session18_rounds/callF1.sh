#!/usr/bin/env bash
# session 18 final round F1 at the merged main: precompile, GPU tests (core heuristic grid + every helper's new tests), sanitizers
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
X=results/NVIDIA_H100_80GB_HBM3/logs/session18_rounds
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt 2>/dev/null
bg() { local name=$1 t=$2; shift 2; ( timeout "$t" "$@" > $L/$name.log 2>&1; echo "$name rc=$? at $(el)s :: $(tail -1 $L/$name.log | cut -c1-150)" >> $L/steps.log ) & }
# phase 1: precompiles in parallel
bg pre_core 150 python3 tests/gpu_precompile.py --no-space --processes 6
bg pre_d128 150 python3 tests/sm90_bwd_d128_precompile.py --no-tests --grid --d64 --rot
bg pre_d256 150 python3 tests/test_sm90_bwd_d256_gpu.py --precompile
bg pre_rol 150 python3 tests/test_sm90_bwd_d256_roles_gpu.py --precompile
bg pre_fwd 150 python3 tests/sm90_fwd_cells_timing.py --dtype bf16,fp16 --with-tests --with-st-tests --order-check --precompile-only
bg pre_feat 150 python3 tests/feat4_precompile.py
bg pre_dec 150 python3 tests/decode_precompile.py --only resident_tests,bandwidth_tests,latency_tests,bulk_tests --processes 4
bg pre_dqc 150 python3 tests/sm90_bwd_dqconv_precompile.py --timing --long
bg pre_drop 150 python3 tests/drop4_precompile.py --timing --quick --masks
wait; echo "phase1 done $(el)s" >> $L/steps.log
# phase 2: GPU tests in parallel groups
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30"
bg t_core 230 $PT tests/test_flash_fwd_gpu.py tests/test_flash_bwd_gpu.py -k "not every_point"
bg t_bwd 230 $PT tests/test_sm90_bwd_d128_gpu.py tests/test_sm90_bwd_gpu.py tests/test_sm90_bwd_dqconv_gpu.py -k "odd_seqlens or gqa_mqa or smaller_real or deterministic_bitwise or heuristic_is or many_tiles or s3_and_d64_rot or dqconv or dq_convert"
bg t_d256 230 $PT tests/test_sm90_bwd_d256_roles_gpu.py tests/test_sm90_bwd_d256_gpu.py
bg t_fwd 230 $PT tests/test_sm90_tile_overlap_gpu.py tests/test_sm90_d64_q2_gpu.py tests/test_feat4_gpu.py tests/test_feature_defaults_gpu.py tests/test_sm90_fwdnc_gpu.py tests/test_sm90_stream_tail_gpu.py
bg t_drop 230 $PT tests/test_drop_early_gpu.py tests/test_dropout_paged_gpu.py tests/test_sm90_dropout_gpu.py
bg t_dec 230 $PT tests/test_decode_resident_gpu.py tests/test_stream_counters_gpu.py tests/test_decode_fused_gpu.py tests/test_decode_bandwidth_gpu.py tests/test_decode_bulk_gpu.py tests/test_decode_gpu.py
wait; echo "phase2 done $(el)s" >> $L/steps.log
# phase 3: sanitizers in parallel
CS="compute-sanitizer --error-exitcode 1"
bg s_memcheck 170 $CS --tool memcheck python3 tests/gpu_sanitize.py
bg s_memcheck_extra 150 $CS --tool memcheck python3 $X/san_extra18.py
bg s_race_sm90_fwd 150 $CS --tool racecheck python3 tests/gpu_sanitize.py --quick --families sm90_fwd
bg s_race_sm90_bwd 150 $CS --tool racecheck python3 tests/gpu_sanitize.py --quick --families sm90_bwd
bg s_race_decode 150 $CS --tool racecheck python3 tests/gpu_sanitize.py --quick --families decode_splitkv
bg s_race_extra 170 $CS --tool racecheck python3 $X/san_extra18.py
bg s_sync 170 $CS --tool synccheck python3 tests/gpu_sanitize.py --families sm90_fwd sm90_bwd
wait; echo "phase3 done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs
