#!/usr/bin/env bash
# session 26 callB: ncu sections of the 1 x 8k decode kernels (cuflash's regs kernel, cuDNN's main and reduction kernels,
# SDPA flash's), warm L2, for the next session's 1 x 8k work.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre 30 python3 tests/decode_b1_timing.py --precompile --processes 4 --cells 1x8k
NS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters"
step ncu 150 ncu --profile-from-start off --cache-control none $NS python3 tests/decode_b1_timing.py --no-precompile --ncu --cells 1x8k
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf callB.tgz logs && rm -rf logs
