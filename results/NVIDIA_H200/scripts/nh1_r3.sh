# Session 30 nh1, GPU round 3: issue 12, the norms' fast path (raw apply, partials with the statistics, the small
# backward in one launch) against main's in one process, the breakdown again; sanitizers and the GPU tests.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
PT="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
step pre 25 python3 tests/layer_norm_precompile.py --processes 15
step bd 40 python3 tests/autograd_host_breakdown.py --out "$OUT/breakdown.json" --calls 200 --rounds 9
bg memcheck 30 compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/layer_norm_sanitize.py
bg racecheck 30 compute-sanitizer --tool racecheck --error-exitcode 3 python3 tests/layer_norm_sanitize.py
bg synccheck 30 compute-sanitizer --tool synccheck --error-exitcode 3 python3 tests/layer_norm_sanitize.py
bg t_ops 30 $PT tests/test_flash_ops_gpu.py -k norm
step t_fast 20 $PT tests/test_layer_norm_gpu.py -k "fast_path or cuda_graph"
wait
step tests $(( 87 - $(el) )) $PT tests/test_layer_norm_gpu.py --maxfail=20
cat "$L/steps.log"
