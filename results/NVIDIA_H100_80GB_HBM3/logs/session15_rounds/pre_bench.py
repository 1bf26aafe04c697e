"""Precompile, in parallel worker processes, what `bench --mode fwd / fwdbwd` selects on this GPU
(every family of the op, FA benchmark shapes, head dims 64/128/256, 2k-16k, causal and not,
bf16 and fp16), the forward of every backward, and decode's default calls."""
import sys, time
from cuflash import _gpu, registry, select
from cuflash.compile import precompile
from cuflash.problem import Problem
arch, smem, name = tuple(_gpu.arch()), _gpu.max_smem(), _gpu.name()
cfgs = []
for op in ("fwd", "bwd"):
    for dtype in ("bf16", "fp16"):
        for d in (64, 128, 256):
            for causal in (False, True):
                for s in (2048, 4096, 8192, 16384):
                    p = Problem.fa_convention(op, dtype, d, causal, s)
                    for fam in registry.families(op):
                        try:
                            _, cfg, _ = select.choose(p, arch, name, smem, family=fam)
                            cfgs.append(cfg)
                        except Exception:
                            pass
t0 = time.time()
res = precompile(cfgs)
print(f"precompiled {len(set(cfgs))} bench configs in {time.time() - t0:.0f} s; errors {sum(1 for r in res if r[2])}")
