#!/usr/bin/env bash
# session 20 final call A, at the merged main: precompile, GPU tests (core heuristic grid + every merged
# branch's tests), sanitizers (memcheck every family; racecheck sm90 + the decode claims; synccheck sm90),
# ring7's simulated memory probe
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
# phase 1: precompiles in parallel
bg pre_core 100 python3 tests/gpu_precompile.py --no-space --processes 6
bg pre_wide 100 python3 tests/test_sm90_bwd_d256_dyn_gpu.py --precompile --no-dyn
bg pre_dec 100 python3 tests/decode_precompile.py --only claims_tests,ringfill_tests,core_tests,host_tests --processes 4
bg pre_fwd 100 python3 tests/sm90_fwd_cells_timing.py --only 256:0:2048,128:0:16384,128:1:8192,64:0:4096 --dtype bf16,fp16 --rows heur,pvo,cl,nost,nost_cl --precompile-only
bg pre_ring 100 python3 tests/ring_precompile.py --procs 4 --seqlens 131072 --head-groups 4 8
wait; echo "phase1 done $(el)s" >> $L/steps.log
# phase 2: GPU tests in parallel groups
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30"
bg t_core 170 $PT tests/test_flash_fwd_gpu.py tests/test_flash_bwd_gpu.py -k "not every_point"
bg t_bwd 170 $PT tests/test_sm90_bwd_gpu.py tests/test_sm90_bwd_d256_gpu.py tests/test_sm90_bwd_d256_dyn_gpu.py tests/test_sm90_bwd_dqfirst_gpu.py -k "odd_seqlens or gqa_mqa or heuristic_is or deterministic_bitwise or wide or dyn or d256 or plain"
bg t_dec 170 $PT tests/test_decode_ringfill_gpu.py tests/test_decode_gpu.py tests/test_decode_host_gpu.py
bg t_fwd 170 $PT tests/test_sm90_pv_overlap_gpu.py tests/test_sm90_fwd_cluster_gpu.py tests/test_sm90_fwdnc_gpu.py tests/test_distributed_dqsum_gpu.py tests/test_cupy_bwd_fastpath_gpu.py
wait; echo "phase2 done $(el)s" >> $L/steps.log
# phase 3: sanitizers in parallel
CS="compute-sanitizer --error-exitcode 1"
bg s_memcheck 150 $CS --tool memcheck python3 tests/gpu_sanitize.py --quick
bg s_race_sm90 150 $CS --tool racecheck python3 tests/gpu_sanitize.py --quick --families sm90_fwd sm90_bwd
bg s_race_dec 150 $CS --tool racecheck python3 tests/decode_claims_sanitize.py
bg s_race_d256dyn 150 $CS --tool racecheck python3 tests/sm90_bwd_d256_race.py --only _dyn
bg s_sync 150 $CS --tool synccheck python3 tests/gpu_sanitize.py --quick --families sm90_fwd sm90_bwd sm90_fwd_fp8
wait; echo "phase3 done $(el)s" >> $L/steps.log
step ring_sim 40 python3 tests/ring_memory_probe.py --simulate 4 2 --local 32768 --variants g4 g8 g4f4 g8f4 --out $L/ring7_final_sim.json
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs && rm -rf logs
