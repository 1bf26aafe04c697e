# drp8 round 4 (55 s, on the merged main): compute-sanitizer (racecheck, synccheck, memcheck) of the new dropout
# backward default (bf16 d128 drop_packed 2 with the plain speed fields), the three tools side by side; one H100
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
step pre 14 python3 tests/drp8_sanitize.py --precompile --causal both
bg racecheck 38 $SAN --tool racecheck --error-exitcode 1 python3 tests/drp8_sanitize.py --new-only --causal both
bg synccheck 38 $SAN --tool synccheck --error-exitcode 1 python3 tests/drp8_sanitize.py --new-only --causal both
bg memcheck 38 $SAN --tool memcheck --error-exitcode 1 python3 tests/drp8_sanitize.py --causal both
wait
