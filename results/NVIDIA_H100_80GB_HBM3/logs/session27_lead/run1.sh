#!/usr/bin/env bash
# on the device: bash run1.sh h1:110 ... ; every req runs in the one merged tree with OUT=$OUT/<h>
ROOT=$PWD; OUT0=$OUT
for spec in "$@"; do
  h=${spec%%:*}; t=${spec##*:}; mkdir -p $OUT0/$h
  s=$(date +%s)
  ( cd $ROOT/tree && OUT=$OUT0/$h timeout -k 5 $t bash $ROOT/reqs/$h.sh > $OUT0/$h/req.out 2>&1; echo "rc=$? wall=$(( $(date +%s) - s ))s" >> $OUT0/$h/req.out )
  echo "$h: $(tail -1 $OUT0/$h/req.out)"
done
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv
cd $OUT0 && for spec in "$@"; do h=${spec%%:*}; tar czf $h.tgz $h && rm -rf $h; done; ls -la $OUT0
