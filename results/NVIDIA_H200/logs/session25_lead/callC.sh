#!/usr/bin/env bash
# session 25 lead call C (H200): dec16's decode shape rules (paged page table, contiguous interleaved prefetch)
# as shipped against emptied, alternating processes, batch 1 and 8 at 8k and 32k keys.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
W=results/NVIDIA_H200/logs/session25_lead/rules.py
B="cuflash bench --mode decode --decode-batches 1 8 --decode-ctxs 8192 32768"
for i in 1 2; do
  step on$i 60 python3 $W on -m $B --out $OUT/res/on$i
  step off$i 60 python3 $W off -m $B --out $OUT/res/off$i
done
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
