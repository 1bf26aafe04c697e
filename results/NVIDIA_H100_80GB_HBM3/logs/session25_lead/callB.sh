#!/usr/bin/env bash
# session 25 lead call B (H100): the contiguous shape rule at batch 64 (callA's bench: 64 x 32k / 64k ~1% slower
# than session 24's table), as shipped by dec16 (batches 2..64) against 2..32, alternating processes.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
W=results/NVIDIA_H100_80GB_HBM3/logs/session25_lead/shaperule.py
B="cuflash bench --mode decode --decode-batches 64 --decode-ctxs 8192 32768 65536"
for i in 1 2 3; do
  step wide$i 60 python3 $W 64 -m $B --out $OUT/res/wide$i
  step narrow$i 60 python3 $W 32 -m $B --out $OUT/res/narrow$i
done
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
