# Session 29 ln3, GPU round 3: the fused backward at 2 chunks a thread (BWD_CHUNKS), checked and timed.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
PT="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
step pre 26 python3 results/NVIDIA_H200/scripts/ln3_round.py precompile
step ab 12 python3 results/NVIDIA_H200/scripts/ln3_round.py ab --out "$OUT/ab.json" --reps 11
step e2e 9 python3 tests/layer_norm_timing.py --dtypes bf16 --shapes 16384x2048,16384x4096 --extra '' --cases rms --reps 9 --out "$OUT/e2e.json"
bg memcheck 24 compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/layer_norm_sanitize.py
bg racecheck 24 compute-sanitizer --tool racecheck --error-exitcode 3 python3 tests/layer_norm_sanitize.py
bg t_old 24 $PT tests/test_flash_ops_gpu.py -k norm
step tests $(( 88 - $(el) )) $PT tests/test_layer_norm_gpu.py --maxfail=40
wait
cat "$L/steps.log"
