"""Session 18, lead: why does the tuner (CuPy flash_attn_backward, back to back) rank sm90_bwd's
non-dynamic configs 5-38% above the dynamic heuristic while the bench (torch autograd) ranks them
3-9% below? Times one backward per path and config, interleaved (cuflash.timing.time_interleaved):
  cupy:auto / cupy:heur / cupy:tuned  -- cuflash.flash_attn_backward on CuPy arrays (config None,
                                         the heuristic's object, the tune's winner)
  torch:auto / torch:tuned            -- the same on torch tensors (what autograd calls)
bf16, FA benchmark shape (batch x seqlen = 16k, heads = 2048 / d)."""
import os, sys, json
sys.path.insert(0, os.getcwd())
import cupy, torch, yaml
import cuflash
from cuflash import registry, _gpu
from cuflash.problem import Problem
from cuflash.timing import time_interleaved

fam = registry.get("sm90_bwd")
tab = yaml.safe_load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "t", "tables_bwd_only",
                                       "NVIDIA_H100_80GB_HBM3_sm90.yaml")))
ents = tab["entries"] if isinstance(tab, dict) else tab
rows = []
for d, causal, s in ((128, True, 2048), (64, False, 2048), (128, False, 8192)):
    b, h = 16384 // s, 2048 // d
    prob = Problem(op="bwd", dtype="bf16", batch=b, seqlen_q=s, seqlen_k=s, nheads=h, nheads_kv=h,
                   head_dim=d, causal=causal)
    heur = fam.for_problem(fam.heuristic(prob, _gpu.arch(0), _gpu.max_smem(0)), prob)
    e = [e for e in ents if e["key"]["family"] == "sm90_bwd" and e["key"]["head_dim"] == d
         and e["key"]["causal"] == causal and e["key"]["seqlen"] == s and e["key"]["dtype"] == "bf16"][0]
    tuned = fam.for_problem(type(heur)(**{"head_dim": d, "dtype": "bf16", "causal": causal, **e["config"]}), prob)
    tq, tk, tv, tdo = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    tout, tlse, _ = cuflash.flash_attn_func(tq, tk, tv, causal=causal, return_attn_probs=True)
    cq, ck, cv, cdo, cout, clse = (cupy.from_dlpack(x) for x in (tq, tk, tv, tdo, tout, tlse))
    bw = cuflash.flash_attn_backward
    fns = {"cupy:auto": lambda: bw(cdo, cq, ck, cv, cout, clse, causal=causal),
           "cupy:heur": lambda: bw(cdo, cq, ck, cv, cout, clse, causal=causal, config=heur),
           "cupy:tuned": lambda: bw(cdo, cq, ck, cv, cout, clse, causal=causal, config=tuned),
           "torch:auto": lambda: bw(tdo, tq, tk, tv, tout, tlse, causal=causal),
           "torch:heur": lambda: bw(tdo, tq, tk, tv, tout, tlse, causal=causal, config=heur),
           "torch:tuned": lambda: bw(tdo, tq, tk, tv, tout, tlse, causal=causal, config=tuned)}
    t = time_interleaved(fns, reps=10, back_to_back=10)
    row = dict(d=d, causal=causal, s=s, heur=heur.name, tuned=tuned.name,
               ms={k: v.median_ms for k, v in t.items()})
    rows.append(row); print(json.dumps(row), flush=True)
json.dump(rows, open("/tmp/lead_bwd_path.json", "w"), indent=1)
