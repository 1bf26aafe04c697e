# session 30 sb1 round 2 (issue 12, short-sequence attention): GPU tests and compute-sanitizer of the head-dim-64
# backward with wide_epi and of the forward's short-key K/V block widths, then two timing processes (main's route,
# the candidates and SDPA in one process each).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
cellsA="64x197x12 128x128x12 32x512x12 64x577x16 8x2048x32 2x8192x32 fp16:64x197x12 fp16:8x2048x32 causal:64x197x12"
cellsB="64x197x12 128x128x12 32x512x12 64x577x16 8x2048x32 2x8192x32"
common="--variants w16 --long-variants w16 --sdpa cudnn --no-fa2 --packed --reps 6 --b2b 5 --profile 0"
fvA="--fwd-variants bal bal_np bn112 bn128 bn144 bn160 bn176"
bg gcomp 18 python tests/test_short_seq_gpu.py --precompile
bg warmdet 18 python -m cuflash warmup --op fwd,bwd --dtype bf16 --hdim 64 --causal both --deterministic --processes 3
wait
bg tcomp 22 python tests/short_seq_timing.py --compile-only --shapes $cellsA $common $fvA
bg gputest 22 python -m pytest -q -p no:cacheprovider tests/test_short_seq_gpu.py
bg vartest 22 python -m pytest -q -p no:cacheprovider tests/test_varlen_gpu.py::test_varlen_packed_variants_match
bg memcheck 22 compute-sanitizer --tool memcheck --print-limit 20 python tests/short_seq_sanitize.py
bg racecheck 22 compute-sanitizer --tool racecheck --print-limit 20 python tests/short_seq_sanitize.py --quick
bg synccheck 22 compute-sanitizer --tool synccheck --print-limit 20 python tests/short_seq_sanitize.py --quick
wait
step timeA 28 python tests/short_seq_timing.py --shapes $cellsA $common $fvA --out "$L/timeA.json"
step timeB 19 python tests/short_seq_timing.py --shapes $cellsB $common --fwd-variants bal bal_np bn128 --out "$L/timeB.json"
echo "total $(el) s" >> "$L/steps.log"
