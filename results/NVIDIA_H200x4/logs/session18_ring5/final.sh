#!/bin/bash
# ring5 final (4 GPUs, <= 6 min wall; every step under its own timeout, 347 s in all): the GPU ring tests,
# then bench --mode ring at P = 4 (1M and 512k light: one timed repetition, torch CP on cuDNN; 256k full:
# 3 repetitions, torch CP on cuDNN and flash, peak memory, single-GPU cuflash on the whole sequence) and
# at P = 2 on GPUs 0 and 1 (256k, 512k, and 1M as the budget allows), the single-GPU shard baseline in
# every cell. Records: /tmp/r5f/<gpu>x4/ring.json and /tmp/r5f/<gpu>x2/ring.json (as bench --mode ring
# writes them under --out; for results/<gpu>x<P>/), copied to /tmp/ring5_final_x4.json, /tmp/ring5_final_x2.json.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
git log --oneline -1; nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.limit --format=csv
timeout 30 python tests/ring_precompile.py --procs 2 3 4 --seqlens 1048576 524288 262144 2>&1 | tail -2
timeout 45 python -m pytest -q -s -x tests/test_distributed_gpu.py -k every_size 2>&1 | grep -E "FAIL|Error|error|Traceback|grid configs|passed|failed" | head -20
timeout 155 python -m cuflash bench --mode ring --ring-procs 4 --ring-seqlens 1048576 524288 262144 --ring-light-from 262144 --ring-budget-s 130 --out /tmp/r5f 2>&1 | tee /tmp/ring5_final_x4.log | grep -v "^  timeline\|^  configs"
cp /tmp/r5f/*x4/ring.json /tmp/ring5_final_x4.json 2>/dev/null
timeout 110 python -m cuflash bench --mode ring --ring-procs 2 --ring-seqlens 262144 524288 1048576 --ring-light-from 262144 --ring-full-max 0 --ring-budget-s 88 --out /tmp/r5f 2>&1 | tee /tmp/ring5_final_x2.log | grep -v "^  timeline\|^  configs"
cp /tmp/r5f/*x2/ring.json /tmp/ring5_final_x2.json 2>/dev/null
timeout 5 python -m cuflash.bench.ring --table /tmp/r5f/*x4/ring.json /tmp/r5f/*x2/ring.json
grep -h "timeline\|configs" /tmp/ring5_final_x4.log | head -24 | cut -c1-330
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
