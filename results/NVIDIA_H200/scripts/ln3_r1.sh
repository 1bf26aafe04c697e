# Session 29 ln3, GPU round: issue 12 (the fused norms' host path, their shared backward row code).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
PT="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
step pre 28 python3 results/NVIDIA_H200/scripts/ln3_round.py precompile
step host 14 python3 tests/layer_norm_host_timing.py --out "$OUT/host.json" --calls 200 --rounds 9
step ab 16 python3 results/NVIDIA_H200/scripts/ln3_round.py ab --out "$OUT/ab.json" --reps 15
bg memcheck 14 compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/layer_norm_sanitize.py
bg racecheck 14 compute-sanitizer --tool racecheck --error-exitcode 3 python3 tests/layer_norm_sanitize.py
bg t_old 14 $PT tests/test_flash_ops_gpu.py -k norm
wait
step tests $(( 88 - $(el) )) $PT tests/test_layer_norm_gpu.py --maxfail=40
cat "$L/steps.log"
