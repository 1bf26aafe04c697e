"""sm90_fwd head dim 96: the exact d96 kernel (heuristic, and BN / consumer variants around it)
against the same tile on the d128 kernel (TMA zero-fills columns 96..127: what d96 ran on
before) and SDPA cuDNN, interleaved, FA convention shapes (bf16, real head dim 96). Prints
one JSON line per cell and writes d96_ab.json (to $OUT, default .).

    PYTHONPATH=. python results/NVIDIA_H100_80GB_HBM3/scripts/d96_ab.py [seqlen ...]
"""
import json, os, sys
import cuflash
from cuflash.bench import common
from cuflash.problem import Problem
from cuflash.registry import get

fam = get("sm90_fwd")
rows = []
seqlens = [int(x) for x in (sys.argv[1:] or ["4096", "16384"])]
for causal in (False, True):
    for s in seqlens:
        p = Problem.fa_convention("fwd", "bf16", 96, causal, s)
        q, k, v = common.inputs(p)
        base = common.heuristic_config(fam, p)
        cfgs = {"d96": base, "d128_same_tile": base.replace(head_dim=128)}
        for bn in (128, 144, 160, 192):
            cfgs[f"d96_BN{bn}"] = base.replace(BN=bn)
        cfgs["d96_persist"] = base.replace(persistent=True)
        cfgs["d96_c3_BN96"] = base.replace(BM=192, consumers=3, BN=96)
        cfgs = {n: c for n, c in cfgs.items() if not c.problems(232448)}
        fns = {n: (lambda c=c: cuflash.flash_attn_func(q, k, v, causal=causal, config=c)) for n, c in cfgs.items()}
        fns["sdpa_cudnn"] = common.op_callable("sdpa_cudnn", p, (q, k, v))
        res = common.measure(fns, reps=20, log=lambda *a: None)
        rec = {"hdim": 96, "causal": causal, "seqlen": s, "config": base.name,
               **{n: round(common.tflops(p, r.median_ms), 1) for n, r in res.items()}}
        rows.append(rec)
        print(json.dumps(rec), flush=True)
        common.release()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "d96_ab.json"), "w"), indent=1)
