"""GPU: sm90_fwd tile shapes for a sliding window 1024 at 8k (d128, bf16, batch 2, 16 heads),
forward only, against the plain causal / full call, to confirm or correct
Sm90Forward.heuristic's window_tiles (cuflash/families/sm90_fwd.py).

    PYTHONPATH=. python results/NVIDIA_H100_80GB_HBM3/scripts/window_sweep.py   (~2-3 min cold)

Prints ms, cuflash / plain and cost / visible (the issue's target: <= 1.15) per config;
"heuristic" is what selection picks now.
"""
import torch

import cuflash
from cuflash.band import visible_fraction
from cuflash.compile import precompile
from cuflash.families.sm90_fwd import Sm90FwdConfig
from cuflash.problem import Problem
from cuflash.select import choose_on_device
from cuflash.timing import time_interleaved

S, D, B, H = 8192, 128, 2, 16
POINTS = [  # BN, persistent
    (176, False), (176, True), (128, False), (128, True), (192, True), (144, True), (160, True)]

torch.manual_seed(0)
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for causal, window in ((True, (1024, 0)), (False, (1024, 1024))):
    configs = {f"BN{bn}{'_persist' if per else ''}": Sm90FwdConfig(128, bn, 2, 2, True, per, D, "bf16", causal)
               for bn, per in POINTS}
    problem = Problem("fwd", "bf16", B, S, S, H, H, D, causal, features=("window",), window=window)
    _, heur, _ = choose_on_device(problem, 0)
    _, plain_cfg, _ = choose_on_device(Problem("fwd", "bf16", B, S, S, H, H, D, causal), 0)
    precompile([c.replace(window=True) for c in configs.values()] + [heur, plain_cfg])
    fns = {name: (lambda c=c: cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, config=c))
           for name, c in configs.items()}
    fns["heuristic"] = lambda: cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window)
    fns["plain"] = lambda: cuflash.flash_attn_func(q, k, v, causal=causal)
    with torch.no_grad():
        t = time_interleaved(fns, reps=20)
    frac = visible_fraction(S, S, causal, window)
    plain = t["plain"].median_ms
    print(f"\nwindow {window} causal={causal}: visible fraction {frac:.4f}, plain {plain_cfg.name} "
          f"{plain:.3f} ms, heuristic {heur.name}")
    for name, tm in t.items():
        print(f"  {name:16s} {tm.median_ms:.3f} ms  x plain {tm.median_ms / plain:.3f}  "
              f"cost / visible {tm.median_ms / plain / frac:.3f}")
