# session 29 dec24 round 3 (issue 13 on one H200): the final commit's kStream (its early prefetch now its own block)
# re-checked: the prefetch GPU tests and the graph test, memcheck / racecheck / synccheck with prefetch calls added.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
t=tests/test_decode_stream_regs_gpu.py
bg pre_t 30 python3 tests/decode_precompile.py --only stream_regs_tests --processes 6
wait
bg t1 40 python3 -m pytest -q -p no:cacheprovider $t -k "prefetch or cuda_graph or ctas7"
bg mem 40 compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/decode_stream_regs_sanitize.py
bg race 40 compute-sanitizer --tool racecheck --error-exitcode 3 python3 tests/decode_stream_regs_sanitize.py
bg sync 40 compute-sanitizer --tool synccheck --error-exitcode 3 python3 tests/decode_stream_regs_sanitize.py
wait
echo "total $(el) s"
