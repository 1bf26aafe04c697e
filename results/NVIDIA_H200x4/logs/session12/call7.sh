#!/usr/bin/env bash
# round C (4 GPUs): distributed GPU tests (P = 2, 3, 4; deterministic, strided K/V), ring benchmark with the new backward
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L
START=$(date +%s); BUDGET=${BUDGET:-450}
step() { local name=$1 t=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then echo "SKIP $name" | tee -a $L/steps.log; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$(date +%s); timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s :: $(tail -1 $L/$name.log)" | tee -a $L/steps.log; }
nvidia-smi -L > $L/gpus.txt 2>&1
step test 170 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_distributed_gpu.py
step ring4 260 python3 -m cuflash bench --mode ring --ring-seqlens 262144 524288 --ring-budget-s 230 --out $OUT/r
cd $OUT && tar czf logs.tgz logs r
