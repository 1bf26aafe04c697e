# gen1 round 1: precompile + GPU tests (in parallel), then the timing alone on the GPU
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
bg precompile 35 python3 tests/generation_cg_precompile.py --processes 10
bg gpu_tests 35 python3 -m pytest -q -s -p no:cacheprovider tests/test_generation_cg_gpu.py
wait
step timing 52 python3 tests/generation_cg_timing.py --reps 2 --out $OUT/timing.json
