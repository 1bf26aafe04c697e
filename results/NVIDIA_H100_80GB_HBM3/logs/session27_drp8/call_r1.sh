# drp8 round 1: where dropout's overhead goes (d128 8k, full and causal), one H100
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
step timing 78 python3 tests/drp8_timing.py --check --reps 10 --out $OUT/r1_timing.json
step ncu 22 $NCU --profile-from-start off --kernel-name regex:sm90_fwd --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis -f -o /tmp/drp8 python3 tests/drp8_ncu.py --causal no --rows plain plain_dyn dropout dpe3 dpe6_tmao
step ncu_export 6 bash -c "$NCU --import /tmp/drp8.ncu-rep --page details > $L/ncu_details.txt 2>&1; $NCU --import /tmp/drp8.ncu-rep --page raw --csv > $L/ncu_raw.csv 2>&1; python3 tests/drp8_ncu.py --summarize $L/ncu_raw.csv > $L/ncu_summary.txt 2>&1; wc -l $L/ncu_details.txt"
