# drp8 round 3 (90 s): GPU tests of the new dropout backward default (DROPOUT_FAST: bf16 d128 drop_packed 2 with the
# plain speed fields), the mask's cross-family tests, and compute-sanitizer of the new kernel; one H100
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
step pre 24 python3 tests/drp8_precompile.py --packed-d128 --cross
step test_fast 16 python3 -m pytest -q -p no:cacheprovider tests/test_drp8_gpu.py
step test_default 20 python3 -m pytest -q -p no:cacheprovider tests/test_dropout_gpu.py tests/test_sm90_dropout_gpu.py tests/test_sm90_bwd_drop_packed_gpu.py -k "(test_dropout_forward_backward_against_reference and bf16_d128) or share_the_mask or (test_drop_packed_backward_against_reference and d128_bf16)"
step racecheck 11 $SAN --tool racecheck --error-exitcode 1 python3 tests/drp8_sanitize.py --causal both
step synccheck 9 $SAN --tool synccheck --error-exitcode 1 python3 tests/drp8_sanitize.py --causal both
step memcheck 9 $SAN --tool memcheck --error-exitcode 1 python3 tests/drp8_sanitize.py --causal both
