# Session 30 nh1, GPU round 1: issue 12, where an eager forward + backward's host time goes (norms, attention).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
lscpu > "$L/lscpu.txt" 2>&1
step pre 25 python3 tests/layer_norm_precompile.py --processes 15
step bd 45 python3 tests/autograd_host_breakdown.py --out "$OUT/breakdown.json" --calls 200 --rounds 9
step tests $(( 88 - $(el) )) python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_layer_norm_gpu.py -k "fast_path or cuda_graph"
cat "$L/steps.log"
