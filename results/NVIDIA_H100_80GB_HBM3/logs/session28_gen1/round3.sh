# gen1 round 3: the timing cells round 2 did not reach (llama1b b1, gpt2 b8, llama1b b8), then gpt2 b1 again
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step precompile 12 python3 tests/generation_cg_precompile.py --processes 4 --only timing
step timing 76 python3 tests/generation_cg_timing.py --reps 2 --cells llama1b:1,gpt2:8,llama1b:8,gpt2:1 --peers cuflash,cuflash_cg,sdpa,sdpa_cg --out $OUT/timing.json
