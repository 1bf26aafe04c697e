"""Varlen on the Hopper families under compute-sanitizer (memcheck / racecheck / synccheck): run
under it, not under pytest (sm_90 only). Small odd-length batches, so every Q block and K/V box
runs past a sequence's end into the next one's rows and past the packed end:

    compute-sanitizer --tool memcheck python tests/sm90_varlen_sanitize.py

sm90_fwd varlen, a CTA per tile and persistent, causal and not, d64 and d128, GQA; sm90_bwd varlen
(switched on here: VARLEN_BWD) with its heuristic (dq_writer) at d128 and the deterministic
red.add kernel at d64. Prints one line per call; the sanitizer's summary says whether any access
was out of bounds.
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cuflash import registry, varlen_torch  # noqa: E402
from cuflash.families import sm90_bwd  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

LENS_Q = [1, 17, 0, 113, 300, 5]
LENS_K = [1, 30, 9, 200, 113, 0]


def main():
    sm90_bwd.VARLEN_BWD = True
    cu_q = torch.tensor(np.cumsum([0] + LENS_Q), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.cumsum([0] + LENS_K), dtype=torch.int32, device="cuda")
    mq, mk = max(LENS_Q), max(LENS_K)
    fwd, bwd = registry.get("sm90_fwd"), registry.get("sm90_bwd")
    for d, causal, det in ((64, True, True), (128, False, False), (128, True, False)):
        h, hkv = 4, 2
        q = torch.randn(sum(LENS_Q), h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(sum(LENS_K), hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        dout = torch.randn_like(q)
        scale = 1 / math.sqrt(d)
        p = Problem("fwd", "bf16", len(LENS_Q), mq, mk, h, hkv, d, causal, False, ("varlen",))
        for persistent in (False, True):
            cfg = fwd.for_problem(fwd.heuristic(p), p).replace(persistent=persistent)
            out, lse = varlen_torch.forward(q, k, v, cu_q, cu_k, mq, mk, scale, causal, cfg)
            torch.cuda.synchronize()
            print(f"{cfg.name}: out finite {bool(out.isfinite().all())}", flush=True)
        pb = p.replace(op="bwd", deterministic=det)
        cfg = bwd.for_problem(bwd.heuristic(pb), pb)
        grads = varlen_torch.backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, scale, causal, det, cfg)
        torch.cuda.synchronize()
        print(f"{cfg.name}: grads finite {all(bool(g.isfinite().all()) for g in grads)}", flush=True)


if __name__ == "__main__":
    main()
