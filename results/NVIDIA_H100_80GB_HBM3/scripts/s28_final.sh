#!/usr/bin/env bash
# session 28, the lead's check of the merged main (ln2, gen1, mdl2, dec20 merged): GPU tests of what the session
# changed, memcheck of the shipped kSpec decode call, bench --mode decode at batch 1, the eager decode call's host
# time, and bench --mode startup for the new calls (kvcache_b1, cross_entropy). Run from the checkout's root.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
git_rev=$(cat REV 2>/dev/null); echo "$git_rev" > $L/rev.txt
bg pre_ln 40 python3 tests/layer_norm_precompile.py --processes 3
bg pre_dec 40 python3 tests/decode_precompile.py --only spec_tests,shipped_b1 --processes 3
bg pre_gen 40 python3 tests/generation_cg_precompile.py --processes 3 --only tests
bg pre_w 40 python3 -m cuflash warmup --op fwd,bwd --dtype bf16,fp16 --hdim 64 --causal both --varlen \
  --decode "batch=1,ctx=4k..128k,page=0,16,256" --helpers all --processes 4
wait
bg t_ln 70 python3 -m pytest -q -p no:cacheprovider -rf tests/test_layer_norm_gpu.py
bg t_dec 95 python3 -m pytest -q -p no:cacheprovider -rf tests/test_decode_spec_gpu.py tests/test_decode_staged_gpu.py -k "spec or batch1"
bg t_mdl 95 python3 -m pytest -q -p no:cacheprovider -rf tests/test_models_gpt_gpu.py tests/test_models_bert_gpu.py \
  tests/test_models_families_gpu.py tests/test_generation_cg_gpu.py
wait
step memcheck 30 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/decode_spec_sanitize.py --b1
step bench_dec 70 python3 -m cuflash bench --mode decode --decode-batches 1 --out $OUT/bench
step host 12 python3 tests/decode_host_timing.py --calls 500 --repeat 2 --out $L/host.json
step startup 110 python3 -m cuflash bench --mode startup --startup-calls kvcache_b1 cross_entropy --repeats 2 --out $OUT/bench
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv >> $L/gpu.txt 2>&1
echo "all done $(el)s" >> $L/steps.log
