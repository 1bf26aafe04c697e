source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
PV=(--variant "fc 0" --variant "p16fc 16" --variant "p256fc 256")
bg pre_t 25 python3 tests/decode_precompile.py --only pair_tests --processes 6
bg pre_p 25 python3 tests/decode_paged_timing.py --precompile --processes 4 --cells 8x32k 8x8k "${PV[@]}"
wait
step bench 38 python3 -m cuflash bench --mode decode --decode-batches 8 32 --out $OUT/bench
step paged 13 python3 tests/decode_paged_timing.py --no-precompile --rounds 9 --max-seconds 9 --cells 8x32k 8x8k "${PV[@]}" --out $OUT/paged.json
step ceil 11 python3 tests/decode_read_ceiling.py --cells 8x32k --rounds 5 --out $OUT/ceil.json
bg t1 22 python3 -m pytest -q -p no:cacheprovider "tests/test_decode_pair_gpu.py::test_pairs_off" "tests/test_decode_pair_gpu.py::test_pairs_cuda_graph"
bg mem 22 compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/decode_pair_sanitize.py
bg race 22 compute-sanitizer --tool racecheck --error-exitcode 3 python3 tests/decode_pair_sanitize.py
wait
echo "total $(el) s"
