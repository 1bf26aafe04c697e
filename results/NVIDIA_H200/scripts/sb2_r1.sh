# session 31 sb2 round 1 (issue 12): screen forward schedules at short non-causal keys (ViT 197, BERT 128; d64 bf16)
# and the causal d64 GPT-2 cells (32 x {128, 256, 512, 1024} x 12 heads: forward variants, backward w16 / nodqf /
# static), each peer x the current default in the same process, SDPA cuDNN / flash alongside. Two processes A / B.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
nc="256x197x12 256x128x12"
ca="causal:32x128x12 causal:32x256x12 causal:32x512x12 causal:32x1024x12"
ncv="--no-bwd --fwd-variants qd tmao qd+tmao stat ovl nopp c1 s4 s3+qd s3+qd+tmao --sdpa cudnn flash"
cav="--variants w16 nodqf static --long-variants w16 nodqf static --no-fa2 --fwd-max-seqlen 1024
     --fwd-variants bn128 c3 qd tmao bn128+qd bn128+qd+tmao c1+bn128 bn128+s3 stat --sdpa cudnn flash"
t="--reps 5 --b2b 10 --profile 0"
bg cnc 45 python tests/short_seq_timing.py --compile-only --shapes $nc $ncv $t
bg cca 45 python tests/short_seq_timing.py --compile-only --shapes $ca $cav $t
wait
step ncA 13 python tests/short_seq_timing.py --no-precompile --shapes $nc $ncv $t --out "$L/ncA.json"
step caA 15 python tests/short_seq_timing.py --no-precompile --shapes $ca $cav $t --out "$L/caA.json"
if [ "$(el)" -lt 62 ]; then step ncB 12 python tests/short_seq_timing.py --no-precompile --shapes $nc $ncv $t --out "$L/ncB.json"; fi
if [ "$(el)" -lt 74 ]; then step caB 14 python tests/short_seq_timing.py --no-precompile --shapes $ca $cav $t --out "$L/caB.json"; fi
echo "total $(el) s" >> "$L/steps.log"
