# session 30 sb1 round 5: racecheck / synccheck / memcheck of the shipped default kernels the earlier quick sets left to
# memcheck alone (fp16 non-causal d64 backward with q_rotate + wide_epi; forward BN 144 / 160 / 176, bf16 and fp16).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step comp 20 python tests/short_seq_sanitize.py --rest --precompile
bg race 30 compute-sanitizer --tool racecheck --print-limit 20 python tests/short_seq_sanitize.py --rest
bg sync 30 compute-sanitizer --tool synccheck --print-limit 20 python tests/short_seq_sanitize.py --rest
bg mem 30 compute-sanitizer --tool memcheck --print-limit 20 python tests/short_seq_sanitize.py --rest
wait
echo "total $(el) s" >> "$L/steps.log"
