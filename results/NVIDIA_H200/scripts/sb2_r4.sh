# session 31 sb2 round 4 (issue 12): the shipped short-call defaults x main's configs at session 31's start, two
# processes A / B: non-causal forward (static persistent + TMA store; variants: dynamic, no pingpong, Q prefetch), fp16
# causal forward + backward (not reached in round 2) and bf16 causal 1024, the packed ViT route (fwd + bwd) x main's
# kernels on it and SDPA.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
nc="256x197x12 256x128x12 128x512x12 64x577x16 fp16:256x197x12"
ncv="--no-bwd --fwd-variants dyn nopp pf --sdpa cudnn"
ca="fp16,causal:32x512x12 fp16,causal:32x1024x12 causal:32x1024x12"
cav="--variants --long-variants --no-fa2 --sdpa cudnn"
pk="--shapes 256x197x12 64x197x12 --packed --no-bwd --no-fwd --sdpa cudnn"
t="--reps 5 --b2b 10 --profile 0"
bg cnc 40 python tests/short_seq_timing.py --compile-only --shapes $nc $ncv $t
bg cca 40 python tests/short_seq_timing.py --compile-only --shapes $ca $cav $t
bg cpk 40 python tests/short_seq_timing.py --compile-only $pk $t
wait
step ncA 12 python tests/short_seq_timing.py --no-precompile --shapes $nc $ncv $t --out "$L/ncA.json"
step caA 12 python tests/short_seq_timing.py --no-precompile --shapes $ca $cav $t --out "$L/caA.json"
step pkA 10 python tests/short_seq_timing.py --no-precompile $pk $t --out "$L/pkA.json"
if [ "$(el)" -lt 64 ]; then step ncB 12 python tests/short_seq_timing.py --no-precompile --shapes $nc $ncv $t --out "$L/ncB.json"; fi
if [ "$(el)" -lt 76 ]; then step caB 12 python tests/short_seq_timing.py --no-precompile --shapes $ca $cav $t --out "$L/caB.json"; fi
if [ "$(el)" -lt 78 ]; then step pkB 10 python tests/short_seq_timing.py --no-precompile $pk $t --out "$L/pkB.json"; fi
echo "total $(el) s" >> "$L/steps.log"
