#!/usr/bin/env bash
# session 23 final call, at the merged main (win5, dec13, dec14, cap10), on one H100: precompiles, the merged
# branches' GPU tests and sanitizers, bench decode (the table of record), bench features' softcap rows, and the
# window backward's host/GPU trace (win5's open question).
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
R=$OUT/res; mkdir -p $R
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20"
bg pre_dec 75 python3 tests/decode_precompile.py --only regs_tests,core_tests --processes 8
bg pre_cap 75 python3 tests/softcap_bwd_timing.py --precompile --tests 128
wait; echo "phase1 done $(el)s" >> $L/steps.log
step t_dec 45 $PT tests/test_decode_gpu.py -k "grid or paged or features or graph or empty"
step t_dec_regs 45 $PT tests/test_decode_regs_gpu.py -k "batch1 or prefetch"
step t_capfold 30 $PT tests/test_sm90_bwd_cap_fold_gpu.py -k d128
CUFLASH_SOFTCAP_SEEDS=4 step t_cap 45 $PT tests/test_softcap_fixed_max_gpu.py tests/test_softcap_seeds_gpu.py
step t_feat_cap 40 $PT tests/test_features_gpu.py -k softcap
echo "phase2 done $(el)s" >> $L/steps.log
CS="compute-sanitizer --error-exitcode 1"
step s_mem_dec 35 $CS --tool memcheck python3 tests/decode_regs_sanitize.py
step s_mem_cap 35 $CS --tool memcheck python3 tests/softcap_fixed_sanitize.py --bwd --quick
echo "phase3 done $(el)s" >> $L/steps.log
step decode 55 python3 -m cuflash bench --mode decode --out $R
step features_cap 50 python3 -m cuflash bench --mode features --feature-cases softcap30_causal softcap30 --out $R/features_softcap
step trace 35 python3 tests/window_bwd_trace.py --reps 10
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
