#!/usr/bin/env bash
# session 25 final call, at the merged main (api8, bwd17, host8, dec16), on one H100: precompiles, the merged
# branches' GPU tests and sanitizers, bench decode (the table of record) and bench startup (every call).
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
R=$OUT/res; mkdir -p $R
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20"
bg pre_dec 75 python3 tests/decode_precompile.py --only core_tests,shape_tests,page_table_tests,regs_tests --processes 10
bg pre_mix 75 python3 tests/test_sm90_varlen_mix_gpu.py --precompile
bg pre_san 60 python3 tests/sm90_varlen_sanitize.py --mixes alibi+window dropout+softcap alibi+dropout+softcap --hdims 64 128 --precompile
wait; echo "phase1 done $(el)s" >> $L/steps.log
# tests: in parallel processes (their float64 references are CPU-bound)
T=tests/test_decode_regs_gpu.py
bg t_dec_core 90 $PT tests/test_decode_gpu.py -k "grid or paged or features or graph or empty"
bg t_pt 110 $PT $T -k "test_regs_page_table"
bg t_shape 110 $PT $T -k "shape_rules"
bg t_b1 90 $PT $T -k "batch1_rules"
bg t_mix 110 $PT tests/test_sm90_varlen_mix_gpu.py
bg t_varfeat 90 $PT tests/test_varlen_features_gpu.py -k "window_right_only_alibi or all_bh_causal"
bg t_rot 90 $PT tests/test_rotary_gpu.py
bg t_mha 110 $PT tests/test_mha_gpu.py
wait; echo "phase2 done $(el)s" >> $L/steps.log
CS="compute-sanitizer --error-exitcode 1"
bg s_mem_dec 60 $CS --tool memcheck python3 tests/decode_regs_sanitize.py --page-table
bg s_mem_mix 60 $CS --tool memcheck python3 tests/sm90_varlen_sanitize.py --mixes alibi+window dropout+softcap alibi+dropout+softcap --hdims 64 128
bg s_mem_rot 60 $CS --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/test_rotary_gpu.py -k "varlen or vector or graph"
bg s_race_rot 60 $CS --tool racecheck python3 -m pytest -q -p no:cacheprovider tests/test_rotary_gpu.py -k "vector"
wait; echo "phase3 done $(el)s" >> $L/steps.log
step decode 90 python3 -m cuflash bench --mode decode --out $R
step startup 110 python3 -m cuflash bench --mode startup --repeats 1 --jobs 3 --out $R
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
