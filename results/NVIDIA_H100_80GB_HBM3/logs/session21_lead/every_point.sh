#!/usr/bin/env bash
# Every point of the fwd and bwd tuning spaces (issue 14's "every point of the space"), sharded
# over N pytest processes on one GPU: the tests are NVRTC-bound, so they run in parallel on the CPUs.
# Run from a snapshot's root with OUT set.
set -u
N=${1:-14}
export PYTHONPATH=$PWD CUPY_CACHE_DIR=/tmp/cupy_cache PYTHONUNBUFFERED=1
T0=$(date +%s)
echo "rev $(cat REV 2>/dev/null)"; nvidia-smi --query-gpu=name --format=csv,noheader
python -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/test_flash_fwd_gpu.py tests/test_flash_bwd_gpu.py \
    -k every_point 2>/dev/null | grep '::' > /tmp/ids
echo "$(wc -l < /tmp/ids) points, $N shards"
cd /tmp && split -n r/$N -d /tmp/ids shard_ && cd - > /dev/null
for s in /tmp/shard_*; do
  b=$(basename $s)
  ( timeout ${BUDGET:-470} python -m pytest -q -m gpu -p no:cacheprovider $(cat $s) > "$OUT/$b.log" 2>&1; echo "rc $?" >> "$OUT/$b.log" ) &
done
wait
echo "[$(( $(date +%s) - T0 ))s] done"
for f in "$OUT"/shard_*.log; do echo "$(basename $f): $(grep -E '^[0-9]+ (passed|failed)|passed|failed' $f | tail -1) $(tail -1 $f)"; done
grep -h "^FAILED\|^ERROR" "$OUT"/shard_*.log | head -40
cd "$OUT" && tar czf every_point.tgz shard_*.log
