#!/bin/bash
# ring6 round 2 (1 x H100, rev 046fc79): a ring of one process (NCCL world 1) through autograd with the
# dQ-in-workspace backward against single-GPU flash_attn_func and float64 (the causal case failed on a stale
# high-priority twin group left by the first case's destroy_process_group: fixed after this round, in
# _transfer_group), then compute-sanitizer memcheck over two of round 1's cases (0 errors).
export PYTHONUNBUFFERED=1
timeout 35 python -m pytest -q -s tests/test_distributed_dqsum_gpu.py -k one_process 2>&1 | grep -E "error|passed|failed|Error" | tail -14
timeout 50 compute-sanitizer --tool memcheck --print-limit 5 python -m pytest -q -x tests/test_distributed_dqsum_gpu.py -k "b2_c256 or causal_det" 2>&1 | grep -E "ERROR SUMMARY|passed|failed|Invalid|Error" | tail -12
