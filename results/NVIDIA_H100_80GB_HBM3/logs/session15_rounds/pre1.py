"""Precompile the valid configs of the tune studies of this call (CuPy disk cache), in parallel."""
import sys, time
from cuflash import _gpu
from cuflash.compile import precompile
from tuning.space import tasks, families_for
arch, smem = tuple(_gpu.arch()), _gpu.max_smem()
todo = []
for op, fam, dtypes, hdims, causals, seqs in (("bwd", "sm90_bwd", ["bf16"], [128, 256], (False, True), [2048, 4096, 8192, 16384]),
                                              ("fwd", "sm90_fwd", ["bf16"], [256], (False,), [2048, 4096, 8192, 16384])):
    t, _ = tasks(families_for([op], [fam]), dtypes, hdims, causals, seqs, arch)
    todo += t
cfgs = list(dict.fromkeys(c for f, p in todo for c in f.valid(p, smem)))
t0 = time.time()
res = precompile(cfgs)
print(f"precompiled {len(cfgs)} configs in {time.time()-t0:.0f}s; errors: {sum(1 for r in res if r[2])}")
for c, s, e in res:
    if e: print("ERR", c, e[:300])
