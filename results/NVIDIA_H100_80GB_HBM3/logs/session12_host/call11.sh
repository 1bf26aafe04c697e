#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L
timeout 120 python3 hostprof12.py > $L/hostprof12.log 2>&1
timeout 90 python3 -m cuflash bench --mode overhead > $L/overhead.log 2>&1
cp results/NVIDIA_H100_80GB_HBM3/overhead.* $L/ 2>/dev/null
cd $OUT && tar czf logs.tgz logs
