#!/bin/bash
# ring6 round 1 (1 x H100, rev 2e824ee): the dQ-in-workspace block calls against the float64 block gradients and
# the old path (tests/test_distributed_dqsum_gpu.py), then tests/ring_dqsum_timing.py (4 non-causal 64k x 64k block
# calls, the two dQ paths alternated, 5 reps, median). The precompile step (a python heredoc) did not run under
# the round's runner ("<stdin>" not found): the test compiled its kernels itself.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout 45 python -m pytest -q -s -rs tests/test_distributed_dqsum_gpu.py 2>&1 | tail -25
timeout 25 python tests/ring_dqsum_timing.py --local 65536 --steps 4 --reps 5 --out /tmp/ring6_dqsum_timing.json 2>&1 | tail -5
