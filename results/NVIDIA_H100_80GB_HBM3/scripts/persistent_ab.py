"""sm90_fwd: one CTA per tile vs persistent (one CTA per SM), same tiles, interleaved with
SDPA cuDNN, FA convention shapes (bf16). Prints one line per cell and writes persistent_ab.json."""
import json, os, sys
import torch
import cuflash
from cuflash.bench import common
from cuflash.problem import Problem
from cuflash.registry import get

fam = get("sm90_fwd")
rows = []
seqlens = [int(x) for x in (sys.argv[1:] or ["2048", "4096", "16384"])]
for d in (64, 128, 192, 256):
    for causal in (False, True):
        for s in seqlens:
            p = Problem.fa_convention("fwd", "bf16", d, causal, s)
            q, k, v = common.inputs(p)
            base = common.heuristic_config(fam, p)
            cfgs = {"tile": base, "persistent": base.replace(persistent=True)}
            fns = {n: (lambda c=c: cuflash.flash_attn_func(q, k, v, causal=causal, config=c)) for n, c in cfgs.items()}
            fns["sdpa_cudnn"] = common.op_callable("sdpa_cudnn", p, (q, k, v))
            res = common.measure(fns, reps=20, log=lambda *a: None)
            rec = {"hdim": d, "causal": causal, "seqlen": s, "config": base.name,
                   **{n: common.tflops(p, r.median_ms) for n, r in res.items()}}
            rows.append(rec)
            print(json.dumps(rec), flush=True)
            common.release()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "persistent_ab.json"), "w"), indent=1)
