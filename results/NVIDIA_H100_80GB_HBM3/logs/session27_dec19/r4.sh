source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
T=tests/test_decode_pair_gpu.py
step pre 15 python3 tests/decode_precompile.py --only pair_tests --processes 8
bg ta 28 python3 -m pytest -q -p no:cacheprovider "$T::test_pairs_off" "$T::test_pairs_cuda_graph"
bg tb 28 python3 -m pytest -q -p no:cacheprovider $T -k "not off and not graph and (page16 or rotary or d64 or h32x4)"
wait
step sync 10 compute-sanitizer --tool synccheck --error-exitcode 3 python3 tests/decode_pair_sanitize.py
echo "total $(el) s"
