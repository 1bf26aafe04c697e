#!/bin/bash
# ring5 round 1 (4 GPUs, <= 4 min wall): the GPU ring tests with DKV_HOME flipped in, the memory probe
# (peak per GPU in units of one local bf16 tensor, P = 4 and 2, DKV_HOME off / on / BWD_LOW_MEMORY, where the peak is),
# and the 1M-token P = 4 cells (causal, then not) with DKV_HOME, BWD_LOW_MEMORY and FWD_FULL_GRID_STEPS = 1
# A/B'd in the same processes (fwd_fullgrid1 is a no-op on the causal cell: its noise floor).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
git log --oneline -1; nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.limit --format=csv
timeout 35 python tests/ring_precompile.py --procs 2 3 4 --seqlens 1048576 262144 2>&1 | tail -3
timeout 55 python -m pytest -q -s -x tests/test_distributed_gpu.py -k every_size 2>&1 | grep -E "FAIL|Error|error|Traceback|grid configs|passed|failed" | head -30
timeout 35 python tests/ring_memory_probe.py --procs 4 --phases --out /tmp/ring5_r1_memory.json 2>&1 | tail -40
timeout 110 python -m cuflash bench --mode ring --ring-procs 4 --ring-seqlens 1048576 --no-torch-cp --ring-full-max 0 --ring-ab dkv_home bwd_lowmem fwd_fullgrid1 --out /tmp/r5 2>&1 | tee /tmp/ring5_r1_bench.log | grep -v "^  timeline\|^  configs"; grep "timeline\|configs" /tmp/ring5_r1_bench.log | cut -c1-420
cp /tmp/r5/*x4/ring.json /tmp/ring5_r1_ring.json 2>/dev/null
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
