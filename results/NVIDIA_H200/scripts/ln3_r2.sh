# Session 29 ln3, GPU round 2: issue 12 (the fused norms' host path, their shared backward row code).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
PT="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
step pre 24 python3 results/NVIDIA_H200/scripts/ln3_round.py precompile
step host 14 python3 tests/layer_norm_host_timing.py --out "$OUT/host.json" --calls 200 --rounds 9
step ab 12 python3 results/NVIDIA_H200/scripts/ln3_round.py ab --out "$OUT/ab.json" --reps 11
step e2e 8 python3 tests/layer_norm_timing.py --dtypes bf16 --shapes 16384x2048 --extra '' --cases rms,rms_res --reps 9 --out "$OUT/e2e_2048.json"
bg memcheck 14 compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/layer_norm_sanitize.py
bg racecheck 14 compute-sanitizer --tool racecheck --error-exitcode 3 python3 tests/layer_norm_sanitize.py
bg t_ce 14 $PT tests/test_cross_entropy_gpu.py
wait
step tests $(( 87 - $(el) )) $PT tests/test_layer_norm_gpu.py tests/test_flash_ops_gpu.py -k "norm or cross_entropy" --maxfail=40
cat "$L/steps.log"
