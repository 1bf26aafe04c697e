# session 31 sb2 round 2 (issue 12): the candidate short-call rules as the default (sm90_fwd SHORT_KEYS_FIELDS:
# tma_store on the short-key non-causal tile; SHORT_CAUSAL_FIELDS: BN 128 + q_double + tma_store on causal d64 below
# the 2048 bucket; sm90_bwd wide_epi on d64 causal up to 2048 queries) x main's configs at session 31's start and
# SDPA cuDNN / flash, two processes A / B; forward variants around the new default (pingpong off, static, q_double off,
# tma_store off, BN 192) and the non-causal 1024-key class (unchanged) with tma_store.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
nc="256x197x12 256x128x12 128x512x12 64x577x16 32x1024x12 fp16:256x197x12"
ca="causal:128x256x12 causal:32x512x12 causal:32x1024x12 causal:16x1440x12 causal:8x2048x12 fp16,causal:32x1024x12"
ncv="--no-bwd --fwd-max-seqlen 1024 --fwd-variants nopp stat tmao+nopp --sdpa cudnn"
cav="--variants --long-variants --no-fa2 --fwd-max-seqlen 1440 --fwd-variants noqd notmao nopp bn192 --sdpa cudnn flash"
t="--reps 5 --b2b 10 --profile 0"
bg cnc 45 python tests/short_seq_timing.py --compile-only --shapes $nc $ncv $t
bg cca 45 python tests/short_seq_timing.py --compile-only --shapes $ca $cav $t
wait
step ncA 14 python tests/short_seq_timing.py --no-precompile --shapes $nc $ncv $t --out "$L/ncA.json"
step caA 16 python tests/short_seq_timing.py --no-precompile --shapes $ca $cav $t --out "$L/caA.json"
if [ "$(el)" -lt 60 ]; then step ncB 13 python tests/short_seq_timing.py --no-precompile --shapes $nc $ncv $t --out "$L/ncB.json"; fi
if [ "$(el)" -lt 73 ]; then step caB 15 python tests/short_seq_timing.py --no-precompile --shapes $ca $cav $t --out "$L/caB.json"; fi
echo "total $(el) s" >> "$L/steps.log"
