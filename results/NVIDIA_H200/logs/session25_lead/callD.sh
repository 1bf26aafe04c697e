#!/usr/bin/env bash
# session 25 lead call D (H200): the shipped H200 table's paged rule (no page table / early prefetch for paged
# caches): which configs selection runs, the paged GPU tests, and the bench cells of callC.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step configs 30 python3 -c "
from cuflash import _gpu, select
from cuflash.problem import Problem
for b, ctx in ((1, 8192), (1, 32768), (8, 8192), (8, 32768)):
    for paged in (False, True):
        p = Problem('decode', 'bf16', b, 1, ctx, 32, 8, 128, False, False, ('paged_kv',) if paged else ())
        fam, cfg, src = select.choose(p, _gpu.arch(), _gpu.name(), _gpu.max_smem(), family='decode_splitkv')
        print(_gpu.name(), b, ctx, 'paged' if paged else 'contiguous', cfg.name, '|', src)
"
step t_paged 80 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_gpu.py -k "paged"
step bench 70 python3 -m cuflash bench --mode decode --decode-batches 1 8 --decode-ctxs 8192 32768 --out $OUT/res
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf logs.tgz logs res && rm -rf logs res
