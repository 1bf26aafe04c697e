#!/usr/bin/env bash
# session 24 final call, at the merged main (win6, drp7 logs, host7, dec15), on one H100: precompiles, the merged
# branches' GPU tests and sanitizers, bench decode (the table of record) and bench overhead (host time, feature rows).
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
R=$OUT/res; mkdir -p $R
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20"
bg pre_dec 80 python3 tests/decode_precompile.py --only regs_tests,core_tests,cluster_tests --processes 10
bg pre_feat 80 python3 tests/features_host_timing.py --precompile-only
bg pre_drop 80 python3 tests/drop4_precompile.py
wait; echo "phase1 done $(el)s" >> $L/steps.log
step t_feat_host 70 $PT tests/test_features_host_gpu.py
step t_dec 45 $PT tests/test_decode_gpu.py -k "grid or paged or features or graph or empty"
step t_dec_regs 90 $PT tests/test_decode_regs_gpu.py -k "batch1 or prefetch or cluster"
step t_drop_plain 40 $PT tests/test_drop_early_gpu.py -k "plain_flags"
echo "phase2 done $(el)s" >> $L/steps.log
CS="compute-sanitizer --error-exitcode 1"
step s_mem_dec 40 $CS --tool memcheck python3 tests/decode_regs_sanitize.py
step s_race_cl 40 $CS --tool racecheck python3 tests/decode_cluster_sanitize.py --quick
echo "phase3 done $(el)s" >> $L/steps.log
step decode 80 python3 -m cuflash bench --mode decode --out $R
step overhead 150 python3 -m cuflash bench --mode overhead --calls 1000 --out $R
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
