#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L
START=$(date +%s); BUDGET=${BUDGET:-420}
step() { local name=$1 t=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then echo "SKIP $name" | tee -a $L/steps.log; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$(date +%s); timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s :: $(tail -1 $L/$name.log)" | tee -a $L/steps.log; }
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
step fp8sweep 200 python3 fp8sweep.py $L/fp8sweep.json
step ncu_fp8 90 $NCU --profile-from-start off --kernel-name regex:sm90_fwd_fp8 --set full -f -o /tmp/fp8 python3 prof1.py fp8
$NCU --import /tmp/fp8.ncu-rep --page details > $L/fp8_details.txt 2>&1
$NCU --import /tmp/fp8.ncu-rep --page raw --csv > $L/fp8_raw.csv 2>&1
cd $OUT && tar czf logs.tgz logs
