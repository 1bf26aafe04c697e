source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step decode 120 python3 -m cuflash bench --mode decode --out $OUT/bench
step feat 90 python3 -m cuflash bench --mode features --feature-cases dropout0.1_causal dropout0.1 --out $OUT/feat
echo "total $(el) s" >> $L/steps.log
