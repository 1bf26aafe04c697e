#!/usr/bin/env bash
# session 24, H200: dec15's batch-1 plain-load hint (REGS_BATCH1_HINT, timed only on the H100) on the other sm_90 card.
# One hint setting per process (load hints change what the next call finds in L2): on / off.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
R=$OUT/res; mkdir -p $R
H="python3 results/NVIDIA_H200/logs/session24_lead/hint.py"
bg pre_on 90 $H on tests/decode_b1_timing.py --precompile --cells 1x4k 1x8k 1x8k_cold --processes 8
bg pre_off 90 $H off tests/decode_b1_timing.py --precompile --cells 1x4k 1x8k 1x8k_cold --processes 8
wait
for i in 1; do
  for s in on off; do
    step b1_${s}_$i 40 $H $s tests/decode_b1_timing.py --no-precompile --cells 1x4k 1x8k 1x8k_cold --repeat 3
    step bench_${s}_$i 75 $H $s -m cuflash bench --mode decode --decode-batches 1 --decode-ctxs 4096 8192 --out $R/bench_${s}_$i
  done
done
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
