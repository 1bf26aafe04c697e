#!/usr/bin/env bash
# session 19 call F5: the rest of bench --mode features (F2 ran out of time after ALiBi): dropout, varlen
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
R=$OUT/res; mkdir -p $R
step features 150 python3 -m cuflash bench --mode features --feature-cases dropout0.1_causal varlen_causal softcap30 --out $R
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
