# Session 30 nh1, GPU round 4: the final tree (raw apply, partials with the statistics; the one-launch backward
# reverted) against main's fast path and torch, 15 interleaved rounds; the fast-path GPU tests.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
PT="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
step pre 25 python3 tests/layer_norm_precompile.py --processes 15
step bd 45 python3 tests/autograd_host_breakdown.py --out "$OUT/breakdown.json" --calls 200 --rounds 15 --stamps 200
step t_fast $(( 87 - $(el) )) $PT tests/test_layer_norm_gpu.py -k "fast_path or cuda_graph"
cat "$L/steps.log"
