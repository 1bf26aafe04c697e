#!/usr/bin/env bash
# session 16, first call: ncu of the current d128 backward (non-causal, causal 16k), racecheck with
# source lines of the d256 dq_writer kernel, ncu of decode 1x8k / 32x8k / 1x8k page 256
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p $L
S=results/NVIDIA_H100_80GB_HBM3/logs/session16_rounds
START=$(date +%s); BUDGET=${BUDGET:-400}
step() { local name=$1 t=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then echo "SKIP $name" | tee -a $L/steps.log; return; fi
  [ "$t" -gt "$left" ] && t=$left
  local t0=$(date +%s); timeout "$t" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s :: $(tail -1 $L/$name.log)" | tee -a $L/steps.log; }
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > $L/gpu.txt 2>&1
git_rev=$(cat REV 2>/dev/null); echo "rev $git_rev" > $L/rev.txt
( CUFLASH_LINEINFO=1 CUPY_CACHE_DIR=/tmp/cupy_li timeout 200 $CS --tool racecheck --racecheck-report all python3 $S/race_dqw.py > $L/race_dqw.log 2>&1; echo "race rc=$?" >> $L/race_dqw.log ) &
RACE=$!
prof() { local n=$1 rx=$2 scr=$3; shift 3
  step ncu_$n 80 $NCU --profile-from-start off --kernel-name regex:"$rx" --set full -f -o /tmp/$n python3 $S/$scr "$@"
  $NCU --import /tmp/$n.ncu-rep --page details > $L/${n}_details.txt 2>&1
  $NCU --import /tmp/$n.ncu-rep --page raw --csv | gzip > $L/${n}_raw.csv.gz 2>&1; }
prof bwd128n16k 'sm90_bwd' prof1.py bwd 128 full 16384
prof bwd128c16k 'sm90_bwd' prof1.py bwd 128 causal 16384
prof dec1x8k 'decode' prof_dec.py 1 8192
prof dec32x8k 'decode' prof_dec.py 32 8192
prof dec1x8kp256 'decode' prof_dec.py 1 8192 256
wait $RACE; echo "race $(tail -1 $L/race_dqw.log)" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs
