# session 31 sb2 round 5 (the last): final-code check of the short-call defaults. Precompile (sb2_r5_precompile.py),
# then in parallel: racecheck / synccheck of the fp16 kernels round 3's quick set left to memcheck
# (short_seq_sanitize.py --s31 --fp16), the short-sequence and packed-gradient GPU tests (all), and the heuristic grid
# tests of sm90_fwd at head dims 40 / 64 and sm90_bwd at 64 (both masks, both dtypes).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step comp 40 python results/NVIDIA_H200/scripts/sb2_r5_precompile.py
bg race 38 compute-sanitizer --tool racecheck --print-limit 20 python tests/short_seq_sanitize.py --s31 --fp16
bg sync 38 compute-sanitizer --tool synccheck --print-limit 20 python tests/short_seq_sanitize.py --s31 --fp16
bg t_ss 46 python -m pytest -q -p no:cacheprovider tests/test_short_seq_gpu.py tests/test_packed_grad_gpu.py
bg t_gf 46 python -m pytest -q -p no:cacheprovider tests/test_flash_fwd_gpu.py -k "test_heuristic_on_the_grid and sm90_fwd and not fp8 and (d64 or d40)"
bg t_gb 46 python -m pytest -q -p no:cacheprovider tests/test_flash_bwd_gpu.py -k "test_heuristic_on_the_grid and sm90_bwd and d64"
wait
echo "total $(el) s" >> "$L/steps.log"
