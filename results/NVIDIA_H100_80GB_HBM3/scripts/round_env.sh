# Sourced by a GPU round's call script (run from the checkout's root on the device, $OUT set by the
# device tool): logs under $OUT/logs, the GPU and revision recorded, and two runners that append one
# line per step to steps.log: step NAME SECONDS CMD... (in order), bg NAME SECONDS CMD... (in the
# background; `wait` for them).
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}" CUPY_CACHE_DIR=/tmp/cupy_cache
L=$OUT/logs; mkdir -p "$L"; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,driver_version --format=csv > "$L/gpu.txt" 2>&1
cat REV > "$L/rev.txt" 2>/dev/null
_log_step() { echo "$1 rc=$2 at $(el)s :: $(tail -1 "$L/$1.log" | cut -c1-150)" >> "$L/steps.log"; }
step() { local name=$1 t=$2; shift 2; timeout "$t" "$@" > "$L/$name.log" 2>&1; _log_step "$name" $?; }
bg() { local name=$1 t=$2; shift 2; ( timeout "$t" "$@" > "$L/$name.log" 2>&1; _log_step "$name" $? ) & }
