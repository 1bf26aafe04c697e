#!/usr/bin/env bash
# session 24, H200: dec15's batch-1 plain-load hint (REGS_BATCH1_HINT, timed only on the H100) on the other sm_90 card.
# One hint setting per process (load hints change what the next call finds in L2): on / off / on / off.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
R=$OUT/res; mkdir -p $R
OFF="from cuflash.families import decode_splitkv as m; m.REGS_BATCH1_HINT = ()"
b1() {  # b1 on|off TAG
  local pre=""; [ "$1" = off ] && pre="$OFF"
  python3 -c "import sys, runpy; $pre
sys.argv = ['decode_b1_timing.py', '--no-precompile', '--cells', '1x4k', '1x8k', '1x8k_cold', '--repeat', '3']
runpy.run_path('tests/decode_b1_timing.py', run_name='__main__')"
}
bench() {  # bench on|off TAG
  local pre=""; [ "$1" = off ] && pre="$OFF"
  python3 -c "import sys, runpy; $pre
sys.argv = ['cuflash', 'bench', '--mode', 'decode', '--decode-batches', '1', '--decode-ctxs', '4096', '8192', '--out', '$R/bench_$2']
runpy.run_module('cuflash', run_name='__main__')"
}
step pre 90 python3 tests/decode_b1_timing.py --precompile --cells 1x4k 1x8k 1x8k_cold --processes 12
for i in 1 2; do
  step b1_on_$i 40 b1 on; step b1_off_$i 40 b1 off
  step bench_on_$i 40 bench on on$i; step bench_off_$i 40 bench off off$i
done
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
