source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step decode1 100 python3 -m cuflash bench --mode decode --decode-batches 1 --out $OUT/bench
echo "total $(el) s" >> $L/steps.log
