# drp8 round 2: the dropout backward with the plain speed fields (DROPOUT_FAST, on for bf16 d128), unbiased timing
# (no explicit seed in the timed calls), and the GPU tests of the new default; one H100
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step timing 55 python3 tests/drp8_timing.py --check --reps 10 --fwd-rows plain_dyn drop_tmao dpe3 dpe3_tmao dpe5_tmao dpe6_tmao --out $OUT/r2_timing.json
step pre 20 python3 tests/drp8_precompile.py
step gputest 33 python3 -m pytest -q -x -p no:cacheprovider tests/test_drp8_gpu.py tests/test_dropout_gpu.py -k "test_fast_dropout_backward or (test_dropout_forward_backward_against_reference and bf16_d128)"
