#!/usr/bin/env bash
# session 15, first call: ncu views of the d128/d256 sm90 kernels, brute-force tune of sm90_bwd (d128, d256) and sm90_fwd d256 non-causal
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L
S=results/NVIDIA_H100_80GB_HBM3/logs/session15_rounds
START=$(date +%s); BUDGET=${BUDGET:-560}
step() { local name=$1 t=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then echo "SKIP $name" | tee -a $L/steps.log; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$(date +%s); timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s :: $(tail -1 $L/$name.log)" | tee -a $L/steps.log; }
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
pip install -q --no-deps --target /tmp/site .whl/*.whl > $L/pip.log 2>&1
( timeout 200 python3 $S/pre1.py > $L/pre1.log 2>&1 ) &
PRE=$!
prof() { local n=$1 rx=$2; shift 2
  step ncu_$n 60 $NCU --profile-from-start off --kernel-name regex:"$rx" --set full -f -o /tmp/$n python3 $S/prof1.py "$@"
  $NCU --import /tmp/$n.ncu-rep --page details > $L/${n}_details.txt 2>&1
  $NCU --import /tmp/$n.ncu-rep --page raw --csv | gzip > $L/${n}_raw.csv.gz 2>&1; }
prof bwd128n16k 'sm90_bwd' bwd 128 full 16384
prof bwd128c16k 'sm90_bwd' bwd 128 causal 16384
prof fwd128n16k 'sm90_fwd' fwd 128 full 16384
prof fwd256n16k 'sm90_fwd' fwd 256 full 16384
prof bwd256n16k 'sm90_bwd' bwd 256 full 16384
wait $PRE; echo "pre1 $(tail -2 $L/pre1.log)" >> $L/steps.log
T="python3 -m cuflash tune --brute-force --no-plots --no-progress --reps 15 --dtype bf16 --seqlen 2048,4096,8192,16384 --out $OUT/res --table-dir $OUT/table"
step tune_bwd 200 $T --op bwd --family sm90_bwd --hdim 128,256
step tune_fwd256 120 $T --op fwd --family sm90_fwd --hdim 256 --causal false
cd $OUT && tar czf logs.tgz logs res table 2>/dev/null || tar czf logs.tgz logs
