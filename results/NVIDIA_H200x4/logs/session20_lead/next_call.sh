#!/usr/bin/env bash
# Prepared in session 20 for the next session's first 4 x H200 call (not run yet): the checks that
# keep issues 14 and 15 open.
#  1. the 4-GPU ring test at the shipped head groups (BWD_HEAD_GROUPS = 8, FWD_HEAD_GROUPS = 4);
#  2. in parallel on single GPUs: train_check (cuflash with sm90_bwd against SDPA flash) on GPU 0, the
#     every_point GPU tests of fwd and bwd on GPU 1;
#  3. bench --mode ring at P = 2 (GPUs 0-1): 512k and 1M, light.
# Run from a snapshot's root with OUT set; everything goes under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD CUPY_CACHE_DIR=/tmp/cupy_cache
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 ))s] $*"; }
echo "rev $(cat REV)"; python -c "import cuflash.distributed as d; print('groups', d.BWD_HEAD_GROUPS, d.FWD_HEAD_GROUPS)"
timeout 40 python tests/ring_precompile.py --procs 2 3 4 --seqlens 1048576 524288 --head-groups 4 8 2>&1 | tail -1; el precompile
timeout 70 python -m pytest -q -s -x -p no:cacheprovider tests/test_distributed_gpu.py -k every_size 2>&1 | grep -E "FAIL|Error|error|Traceback|passed|failed" | head -30; el ring_test
( CUDA_VISIBLE_DEVICES=0 timeout 200 python -m cuflash.train_check --attn cuflash sdpa_flash --out "$OUT/train" > "$OUT/train_check.log" 2>&1; echo "train_check rc $?" >> "$OUT/train_check.log" ) &
( CUDA_VISIBLE_DEVICES=1 timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_flash_fwd_gpu.py tests/test_flash_bwd_gpu.py -k every_point > "$OUT/every_point.log" 2>&1; echo "every_point rc $?" >> "$OUT/every_point.log" ) &
wait; tail -4 "$OUT/train_check.log" "$OUT/every_point.log"; el singles
timeout 200 python -m cuflash bench --mode ring --ring-procs 2 --ring-seqlens 524288 1048576 --ring-light-from 524288 --ring-budget-s 190 --out "$OUT/res" 2>&1 | tee "$OUT/bench_x2.log" | grep -v "^  timeline\|^  configs\|^  breakdown\|[Ww]arn\|stale\|choose_on_device"; el bench_x2
cd $OUT && tar czf next_call.tgz * ; el done
