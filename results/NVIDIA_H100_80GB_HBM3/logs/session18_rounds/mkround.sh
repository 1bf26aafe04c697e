#!/usr/bin/env bash
# usage: mkround.sh CALLNAME helper1 helper2 ... : snapshot each helper branch HEAD into .dev/snap/<h>, extract its request block
set -e
cd /work/main
call=$1; shift
rm -rf .dev/snap && mkdir -p .dev/snap
for hh in "$@"; do
  h=${hh%%:*}
  mkdir -p .dev/snap/$h
  git -C /work/wt-$h archive HEAD cuflash kernels_cu tuning tests setup.cfg README.md | tar -x -C .dev/snap/$h
  python3 - "$h" <<'PY'
import sys,re
h=sys.argv[1]
s=open(f'/work/notes/gpu_request_{h}.md').read()
blocks=re.findall(r"```bash\n(.*?)```", s, re.S)
open(f'/work/main/.dev/snap/{h}/req.sh','w').write("set -u\n"+blocks[0])
PY
  git -C /work/wt-$h rev-parse --short HEAD > .dev/snap/$h/REV
done
cat > .dev/snap/run.sh <<'EOS'
#!/usr/bin/env bash
L=$OUT/logs; mkdir -p $L; START=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv > $L/gpu.txt 2>&1
pip install -q --no-deps --target /tmp/site whl/*.whl > $L/pip.log 2>&1
export CUPY_CACHE_DIR=/tmp/cupy_cache PYTHONUNBUFFERED=1
for hh in "$@"; do
  h=${hh%%:*}; t=${hh##*:}; [ "$t" = "$hh" ] && t=${HT:-95}
  ( cd $h && export PYTHONPATH=$PWD:/tmp/site && echo "rev $(cat REV)" && timeout $t bash req.sh ) > $L/$h.log 2>&1
  echo "$h done rc=$? at $(( $(date +%s) - START ))s" | tee -a $L/steps.log
  mkdir -p $L/json_$h; cp /tmp/*.json $L/json_$h/ 2>/dev/null; rm -f /tmp/*.json
done
cd $OUT && tar czf logs.tgz logs $(ls *.json 2>/dev/null)
EOS
chmod +x .dev/snap/run.sh
mkdir -p .dev/snap/whl && cp .whl/*.whl .dev/snap/whl/
echo "snap ready: $(ls .dev/snap)"
