#!/bin/bash
# ring6 round 3 (1 x H100, rev 022fc02): the ring of one process, causal and not, after the twin-group fix.
export PYTHONUNBUFFERED=1
timeout 40 python -m pytest -q -s tests/test_distributed_dqsum_gpu.py -k one_process 2>&1 | grep -E "error|passed|failed|Error" | tail -14
