#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L
START=$(date +%s); BUDGET=${BUDGET:-480}
step() { local name=$1 t=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then echo "SKIP $name" | tee -a $L/steps.log; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$(date +%s); timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s :: $(tail -1 $L/$name.log)" | tee -a $L/steps.log; }
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
nvidia-smi > $L/gpu.txt 2>&1
step startup 150 python3 -m cuflash bench --mode startup --out $L/startup
step bwdbreak 150 python3 bwdbreak.py $L/bwdbreak.json
prof() { local n=$1 rx=$2; shift 2
  step ncu_$n 90 $NCU --profile-from-start off --kernel-name regex:"$rx" --set full -f -o /tmp/$n python3 prof2.py "$@"
  $NCU --import /tmp/$n.ncu-rep --page details > $L/${n}_details.txt 2>&1
  $NCU --import /tmp/$n.ncu-rep --page raw --csv | gzip > $L/${n}_raw.csv.gz 2>&1; }
prof bwd128n16k 'sm90_bwd' bwd_128_n_16384
prof bwd128c2k 'sm90_bwd' bwd_128_c_2048
prof fwd128n16k 'sm90_fwd' fwd_128_n_16384
cd $OUT && tar czf logs.tgz logs
