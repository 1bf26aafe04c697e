#!/usr/bin/env bash
# round B2: decode fix, sm90_bwd tests (dq_writer heuristic), brute-force sm90_bwd tuning, sanitizers of the new kernels
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L
START=$(date +%s); BUDGET=${BUDGET:-580}
step() { local name=$1 t=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then echo "SKIP $name" | tee -a $L/steps.log; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$(date +%s); timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s :: $(tail -1 $L/$name.log)" | tee -a $L/steps.log; }
pip install -q --no-deps --target /tmp/site .whl/*.whl > $L/pip.log 2>&1
PT="python3 -m pytest -m gpu -q -p no:cacheprovider"
step bisect 60 python3 decode_bisect.py
step t_decode 100 $PT tests/test_decode_gpu.py tests/test_decode_fused_gpu.py
step t_bwd 120 $PT tests/test_sm90_bwd_gpu.py tests/test_sm90_bwd_features_gpu.py tests/test_sm90_bwd_sched_gpu.py tests/test_sm90_bwd_dqbulk_gpu.py
step tune_bwd 200 python3 -m cuflash tune --op bwd --family sm90_bwd --brute-force --dtype bf16,fp16 --hdim 64,128 --causal both --seqlen 2048,4096,8192,16384 --table-dir tuning/configs --no-progress --no-plots
step sync_bwd 60 compute-sanitizer --tool synccheck --error-exitcode 1 python3 tests/gpu_sanitize.py --families sm90_bwd sm90_fwd_fp8
step race_bwd 60 compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/gpu_sanitize.py --quick --families sm90_bwd sm90_fwd_fp8
step mem_new 60 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu_sanitize.py --families sm90_bwd sm90_fwd_fp8 decode_splitkv
step race_dec_fused 60 compute-sanitizer --tool racecheck --error-exitcode 1 python3 -c "import cuflash.families.decode_splitkv as m; m.FUSED_COMBINE_DEFAULT = m.PAGE_PREFETCH_DEFAULT = True; import sys; sys.argv = ['s', '--quick', '--families', 'decode_splitkv']; sys.path.insert(0, 'tests'); import gpu_sanitize; sys.exit(gpu_sanitize.main())"
step mem_dec_fused 60 compute-sanitizer --tool memcheck --error-exitcode 1 python3 -c "import cuflash.families.decode_splitkv as m; m.FUSED_COMBINE_DEFAULT = m.PAGE_PREFETCH_DEFAULT = True; import sys; sys.argv = ['s', '--families', 'decode_splitkv']; sys.path.insert(0, 'tests'); import gpu_sanitize; sys.exit(gpu_sanitize.main())"
mkdir -p $OUT/tables && cp tuning/configs/*.yaml $OUT/tables/
cd $OUT && tar czf logs.tgz logs tables
