#!/usr/bin/env bash
# session 20, the lead's third 4 x H200 call: bench --mode ring at P = 4, 1M and 512k (light), with the
# shipped head groups (BWD_HEAD_GROUPS = 8, FWD_HEAD_GROUPS = 4), next to torch CP on cuDNN and the
# single-GPU shard.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD CUPY_CACHE_DIR=/tmp/cupy_cache
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 ))s] $*"; }
echo "rev $(cat REV)"; python -c "import cuflash.distributed as d; print('groups', d.BWD_HEAD_GROUPS, d.FWD_HEAD_GROUPS)"
timeout 30 python tests/ring_precompile.py --procs 4 --seqlens 1048576 524288 --head-groups 4 8 2>&1 | tail -1; el precompile
timeout 170 python -m cuflash bench --mode ring --ring-procs 4 --ring-seqlens 1048576 524288 --ring-light-from 524288 --ring-budget-s 160 --out "$OUT/res" 2>&1 | tee "$OUT/bench_x4.log" | grep -v "^  timeline\|^  configs\|^  breakdown\|[Ww]arn\|stale\|choose_on_device"; el bench_x4
cd $OUT && tar czf multi3.tgz * ; el done
