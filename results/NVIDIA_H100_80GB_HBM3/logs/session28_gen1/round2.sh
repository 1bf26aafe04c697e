# gen1 round 2: precompile and the GPU tests (EAGER_LENGTHS_TENSOR off and on) in parallel, then the timing alone
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
bg precompile 25 python3 tests/generation_cg_precompile.py --processes 10
bg tests_off 30 python3 -m pytest -q -s -p no:cacheprovider tests/test_generation_cg_gpu.py tests/test_models_gpt_gpu.py -k "cg or generate"
bg tests_on 30 python3 -c "import sys, pytest, cuflash.utils.generation as g; g.EAGER_LENGTHS_TENSOR = True; sys.exit(pytest.main(['-q', '-s', '-p', 'no:cacheprovider', 'tests/test_generation_cg_gpu.py', 'tests/test_models_gpt_gpu.py', '-k', 'cg or generate']))"
wait
step timing 58 python3 tests/generation_cg_timing.py --reps 2 --out $OUT/timing.json
