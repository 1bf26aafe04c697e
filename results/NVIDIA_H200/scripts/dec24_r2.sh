# session 29 dec24 round 2 (issue 13 on one H200): kStream again in a second process (stk, stkp3, stk128 against the
# shipped call, fc0 and SDPA), two probes of the per-CTA depth the plain-reader ceiling points at (regs_staged 1 / 2:
# more blocks in flight per warp; 4 warps x 4 splits, two CTAs per SM), then kStream's GPU tests (3 processes) and
# compute-sanitizer memcheck / racecheck / synccheck on tests/decode_stream_regs_sanitize.py.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
cells=(8x32k 8x8k 32x8k 64x32k)
o0="light_fence=0 regs_order=0 regs_prefetch=0 regs_prefetch_blocks=1"
var=(--variant "fc0 regs_order=0 regs_prefetch=0 regs_prefetch_blocks=1" --variant "stk stream=1 $o0"
     --variant "stkp3 stream=1 light_fence=0 regs_order=0 regs_prefetch=1 regs_prefetch_blocks=3"
     --variant "stk128 stream=1 $o0 splits=128" --variant "rst1 regs_staged=1" --variant "rst2 regs_staged=2"
     --variant "w4s4 warps=4 splits=4")
t=tests/test_decode_stream_regs_gpu.py
bg pre 30 python3 tests/decode_b1_timing.py --precompile --processes 6 --cells "${cells[@]}" "${var[@]}"
bg pre_t 30 python3 tests/decode_precompile.py --only stream_regs_tests --processes 6
wait
step time 30 python3 tests/decode_b1_timing.py --no-precompile --repeat 9 --max-seconds 26 --cells "${cells[@]}" "${var[@]}" --out $OUT/time.json
bg t1 40 python3 -m pytest -q -p no:cacheprovider $t -k "test_stream_regs and not ctas and not prefetch and not graph"
bg t2 40 python3 -m pytest -q -p no:cacheprovider $t -k "ctas or cuda_graph"
bg t3 40 python3 -m pytest -q -p no:cacheprovider $t -k "prefetch"
bg mem 40 compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/decode_stream_regs_sanitize.py
bg race 40 compute-sanitizer --tool racecheck --error-exitcode 3 python3 tests/decode_stream_regs_sanitize.py
bg sync 40 compute-sanitizer --tool synccheck --error-exitcode 3 python3 tests/decode_stream_regs_sanitize.py
wait
echo "total $(el) s"
