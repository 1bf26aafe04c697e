source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
OLD="fused_combine=1 light_fence=1 early_merge=0 pdl=0"
bg pre 40 python3 tests/decode_paged_timing.py --precompile --cells 1x8k --pages 16 256 --variant "old16 16 $OLD" --variant "old256 256 $OLD" --processes 8
bg tpre 40 python3 tests/decode_precompile.py --only shipped_b1 --processes 4
wait
step timing 45 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --pages 16 256 --variant "old16 16 $OLD" --variant "old256 256 $OLD" --rounds 9 --out $OUT/paged.json
step tests 90 python3 -m pytest -q -p no:cacheprovider -rA tests/test_decode_staged_gpu.py -k "paged_rule"
step memcheck 45 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/test_decode_staged_gpu.py -k "paged_rule and splits0 and l8192"
step racecheck 45 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/test_decode_staged_gpu.py -k "paged_rule and splits0 and l8192 and page16"
echo "total $(el) s" >> $L/steps.log
