#!/usr/bin/env bash
# The whole GPU validation of a checkout, time-boxed step by step (for a lent GPU machine
# whose commands are capped at 10 minutes: run it in two halves, `gpu_session.sh check` and
# `gpu_session.sh measure`). Logs go to $OUT (default results/<gpu>/logs); results to results/<gpu>/.
#
#   check:   precompile (parallel), GPU tests (fwd, bwd, tuning), then sanitize
#   sanitize: compute-sanitizer memcheck on every family and the API features, racecheck per
#            family and on the features, synccheck on the sm_90 families (tests/gpu_sanitize.py)
#   features: GPU tests of window/softcap/ALiBi, varlen, dropout, decode, FP8, sm90_bwd, the
#            windowed persistent forward, varlen with features and paged varlen
#   varlenfeat: GPU tests of varlen with window/softcap/ALiBi/dropout and of block_table (paged)
#   measure: overhead, startup, fwd, fwd+bwd benchmarks, IO table
#   measure2: FP8 forward, features, dropout, varlen and decode benchmarks
#   tune:    re-tune this GPU's table (bf16 and fp16; forward d 64/128/256, backward d 64/128;
#            buckets 2k-16k) into tuning/configs
#            (needs optuna: pip install -e '.[tune]', or carried wheels on a machine without a network)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/cuflash_cupy_cache}"
GPU=$(python3 -c "from cuflash import _gpu; print(_gpu.name().replace(' ', '_'))") || exit 2
OUT="${OUT:-results/$GPU/logs}"; mkdir -p "$OUT"
START=$(date +%s); BUDGET=${BUDGET:-570}
step() {  # name seconds command...: skipped when the budget is spent
  local name=$1 t=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then echo "SKIP $name" | tee -a "$OUT/steps.log"; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$(date +%s); timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.log"
}
sanitize() {  # memcheck on everything; racecheck (--quick shapes) per family (so a slow one does not hide the rest); synccheck on sm_90 families
  step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu_sanitize.py
  step memcheck_features 150 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu_sanitize.py --features
  for fam in fa2_fwd fa2_bwd sm90_fwd sm90_fwd_fp8 sm90_bwd decode_splitkv; do
    step "racecheck_$fam" 150 compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/gpu_sanitize.py --quick --families "$fam"
  done
  step racecheck_features 200 compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/gpu_sanitize.py --quick --features
  step synccheck 150 compute-sanitizer --tool synccheck --error-exitcode 1 python3 tests/gpu_sanitize.py --families sm90_fwd sm90_fwd_fp8 sm90_bwd
  step synccheck_features 150 compute-sanitizer --tool synccheck --error-exitcode 1 python3 tests/gpu_sanitize.py --quick --features
}
case "${1:-check}" in
  check)
    step precompile 120 python3 tests/gpu_precompile.py --processes "$(nproc)"
    step pytest_core 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_flash_fwd_gpu.py tests/test_flash_bwd_gpu.py tests/test_tuning_gpu.py
    sanitize
    ;;
  sanitize)  # compute-sanitizer only (kernels compiled by an earlier step or run)
    sanitize
    ;;
  features)  # the flash_attn API's features and the newer families, one step each
    step precompile 120 python3 tests/gpu_precompile.py --processes "$(nproc)"
    step features 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_features_gpu.py
    step varlen 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen_gpu.py
    step dropout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_dropout_gpu.py
    step decode 180 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_gpu.py
    step fp8 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_gpu.py
    step sm90_bwd 180 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_sm90_bwd_gpu.py tests/test_sm90_bwd_features_gpu.py
    step window 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_window_gpu.py
    step varlen_features 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen_features_gpu.py
    step varlen_paged 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen_paged_gpu.py
    ;;
  varlenfeat)  # varlen with window/softcap/ALiBi/dropout, and block_table (fa2_fwd_paged)
    step varlen_features 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen_features_gpu.py
    step varlen_paged 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen_paged_gpu.py
    ;;
  measure)
    step overhead 60 python3 -m cuflash bench --mode overhead
    step startup 100 python3 -m cuflash bench --mode startup --repeats 3
    step fwdbwd 120 python3 -m cuflash bench --mode fwdbwd --hdims 64 128 --seqlens 2048 4096 8192 16384
    step fwd 90 python3 -m cuflash bench --mode fwd --hdims 64 128 256
    step io 150 python3 -m cuflash bench --mode io
    ;;
  measure2)  # the newer benchmarks
    step fp8 60 python3 -m cuflash bench --mode fwd --fp8 --hdims 64 128 256 --seqlens 4096 16384
    step features 240 python3 -m cuflash bench --mode features
    step dropout 120 python3 -m cuflash bench --mode dropout
    step varlen 120 python3 -m cuflash.bench.varlen --hdims 128
    step decode 240 python3 -m cuflash bench --mode decode
    ;;
  tune)
    step tune_fwd 240 python3 -m cuflash tune --op fwd --trials 10 --dtype bf16,fp16 --hdim 64,128,256 --causal both --seqlen 2048,4096,8192,16384 --table-dir tuning/configs --no-progress --no-plots
    step tune_bwd 300 python3 -m cuflash tune --op bwd --trials 8 --dtype bf16,fp16 --hdim 64,128 --causal both --seqlen 2048,4096,8192,16384 --table-dir tuning/configs --no-progress --no-plots
    ;;
  *) echo "usage: tests/gpu_session.sh [check|sanitize|features|measure|measure2|tune]"; exit 2 ;;
esac
