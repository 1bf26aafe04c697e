#!/usr/bin/env bash
# session 17, lead's part of the first call: ncu of the shipped d128 backward (non-causal 16k, bf16):
# the main kernel's tensor-pipe utilisation and stall reasons, for issue 14's note
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/lead; mkdir -p $L
S=results/NVIDIA_H100_80GB_HBM3/logs/session17_rounds
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
cat REV > $L/rev.txt 2>/dev/null
t0=$(date +%s)
timeout 120 $NCU --profile-from-start off --kernel-name regex:'sm90_bwd' --set full -f -o /tmp/bwd128n16k python3 results/NVIDIA_H100_80GB_HBM3/logs/session16_rounds/prof1.py bwd 128 full 16384 > $L/ncu_bwd128n16k.log 2>&1
echo "ncu rc=$? $(( $(date +%s) - t0 ))s" >> $L/steps.log
$NCU --import /tmp/bwd128n16k.ncu-rep --page details > $L/bwd128n16k_details.txt 2>&1
$NCU --import /tmp/bwd128n16k.ncu-rep --page raw --csv | gzip > $L/bwd128n16k_raw.csv.gz 2>&1
