#!/usr/bin/env bash
# 2 GPUs: the ring benchmark with the dq_writer backward
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p $L
nvidia-smi -L > $L/gpus.txt 2>&1
timeout 250 python3 -m cuflash bench --mode ring --ring-seqlens 262144 524288 --ring-budget-s 220 --out $OUT/r > $L/ring2.log 2>&1
echo "ring2 rc=$?" >> $L/ring2.log
cd $OUT && tar czf logs.tgz logs r
