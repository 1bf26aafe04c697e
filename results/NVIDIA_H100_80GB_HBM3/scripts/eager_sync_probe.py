"""Does one eager forward + backward wait for the GPU inside its host path? (bench overhead's
eager_fwdbwd shape: b=8 s=2k h=16 d=128 causal bf16; the calls of eager_gap_profile.make). Per
implementation, medians over 20 calls of: the forward call's host time, the backward() call's host time
(no synchronize before it), the final synchronize's wait, and the whole call; a backward() whose host
time reaches the GPU's forward + backward time waited for the GPU inside it."""
import statistics
import time

import torch

from eager_gap_profile import make

for impl in ("cuflash", "cudnn", "flash"):
    call, ctx = make(impl)
    rows = []
    with ctx():
        for i in range(25):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = call.forward()
            t1 = time.perf_counter()
            out.sum().backward()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            if i >= 5:
                rows.append(((t1 - t0) * 1e6, (t2 - t1) * 1e6, (t3 - t2) * 1e6, (t3 - t0) * 1e6))
    med = [statistics.median(r[j] for r in rows) for j in range(4)]
    print(f"{impl:8s} fwd host {med[0]:7.1f} us  backward() host {med[1]:7.1f} us  final wait {med[2]:7.1f} us"
          f"  whole {med[3]:7.1f} us")
