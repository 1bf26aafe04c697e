"""Peak memory of the ring per GPU, in units of X = one local (batch, seqlen/P, heads, d) bf16
tensor, and where it is reached (not a test; a GPU diagnostic for the memory model of
cuflash.distributed, issue 15).

    python tests/ring_memory_probe.py [--local 32768] [--heads 8] [--procs 4]

One spawn of --procs processes; rings of P = procs and P = 2 (the first two ranks), every
rank holding --local positions (so X is the same for every P), causal (zigzag) and not, with the
backward's memory flags of VARIANTS (--variants: some of them): "low" (BWD_LOW_MEMORY, session
18's default), "low+dq" (DQ_IN_WORKSPACE too), "low+dq+lazy" (and HOME_LAZY_FP32: session 19's
defaults), "travel" (an fp32 accumulator travelling with each block), all heads at once; "g2",
"g4", "g8" (low+dq+lazy, the backward's ring once per group of heads: BWD_HEAD_GROUPS; g4 the
default), "g4f4", "g8f4" (the forward's ring per 4 groups too: FWD_HEAD_GROUPS). For each: the peak
of one autograd forward + backward above the inputs (q, k, v, dout: 4 X), as bench --mode ring
counts it, and single-GPU flash_attn_func on the same --local positions (its peak above its
inputs) and, with --whole, on P x --local positions (the sequence a ring of P ranks splits; in
units of the ring's X: what a ring's peak is to be 1/P of). With --phases, rank 0 also prints
live memory (X) after every block call and transfer start, and the peak since the previous
record, for P = procs and P = 2 non-causal: which buffers are live at the peak.

    python tests/ring_memory_probe.py --simulate 4 2 [--local 65536] [--variants ...]

--simulate: no process group of several GPUs: one process on one GPU plays rank 0 of rings of
those sizes (simulated_ring: every transfer a buffer made on the GPU, the same buffers and calls
as that rank of a real ring), giving each variant's peak and its forward's and backward's times
(no NVLink, so the cost of the smaller calls and of the copies, not of the transfers).
"""
import argparse
import datetime
import json
import os
import socket
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_here)]

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


# variant -> cuflash.distributed flags (the others as the module has them)
_LAZY = dict(DKV_HOME=False, BWD_LOW_MEMORY=True, DQ_IN_WORKSPACE=True, HOME_LAZY_FP32=True)
_ALL_HEADS = dict(BWD_HEAD_GROUPS=1, FWD_HEAD_GROUPS=1)
VARIANTS = {
    "travel": dict(DKV_HOME=False, BWD_LOW_MEMORY=False, DQ_IN_WORKSPACE=False,
                   HOME_LAZY_FP32=False, **_ALL_HEADS),
    "low": dict(DKV_HOME=False, BWD_LOW_MEMORY=True, DQ_IN_WORKSPACE=False, HOME_LAZY_FP32=False,
                **_ALL_HEADS),
    "low+dq": dict(DKV_HOME=False, BWD_LOW_MEMORY=True, DQ_IN_WORKSPACE=True, HOME_LAZY_FP32=False,
                   **_ALL_HEADS),
    "low+dq+lazy": dict(**_LAZY, **_ALL_HEADS),  # (session 19's defaults)
    # BWD_HEAD_GROUPS: the backward's ring once per group of heads
    "g2": dict(**_LAZY, BWD_HEAD_GROUPS=2, FWD_HEAD_GROUPS=1),
    "g4": dict(**_LAZY, BWD_HEAD_GROUPS=4, FWD_HEAD_GROUPS=1),
    "g8": dict(**_LAZY, BWD_HEAD_GROUPS=8, FWD_HEAD_GROUPS=1),
    # and the forward's ring once per group of heads too (FWD_HEAD_GROUPS)
    "g4f4": dict(**_LAZY, BWD_HEAD_GROUPS=4, FWD_HEAD_GROUPS=4),
    "g8f4": dict(**_LAZY, BWD_HEAD_GROUPS=8, FWD_HEAD_GROUPS=4),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _instrument(cfd, torch, log: list, X: int):
    """Wrap the ring's block calls and transfers to append (what, step, live X, peak X since the
    last record); returns a function that undoes it."""
    saved = cfd.block_forward, cfd.block_backward, cfd._Ring.start, cfd._Ring.finish, \
        cfd._DqSum.block

    def record(what, step):
        torch.cuda.synchronize()
        log.append((what, step, torch.cuda.memory_allocated() / X,
                    torch.cuda.max_memory_allocated() / X))
        torch.cuda.reset_peak_memory_stats()

    def fwd(*a, **kw):
        out = saved[0](*a, **kw)
        record("fwd_block", a[5] if len(a) > 5 else kw.get("step", 0))
        return out

    def bwd(*a, **kw):
        out = saved[1](*a, **kw)
        record("bwd_block", a[9] if len(a) > 9 else kw.get("step", 0))
        return out

    def sums_block(self, *a, **kw):  # (DQ_IN_WORKSPACE: the ring's block calls)
        out = saved[4](self, *a, **kw)
        record("bwd_block", a[10] if len(a) > 10 else kw.get("step", 0))
        return out

    def start(self, tensors, *a, **kw):
        out = saved[2](self, tensors, *a, **kw)
        trace = kw.get("trace") or (a[2] if len(a) > 2 else None)
        record("start " + (trace[0] if trace else "?"), trace[1] if trace else -1)
        return out

    def finish(self, reqs):
        saved[3](self, reqs)
        record("finish", -1)

    cfd.block_forward, cfd.block_backward, cfd._Ring.start, cfd._Ring.finish = fwd, bwd, start, finish
    cfd._DqSum.block = sums_block

    def undo():
        cfd.block_forward, cfd.block_backward, cfd._Ring.start, cfd._Ring.finish, \
            cfd._DqSum.block = saved
    return undo


def _peak(torch, fn, log=(), X: int = 1) -> int:
    """Peak allocated during fn() above what was allocated before; with a phase log (whose records
    reset the peak statistic) the largest of its peaks counts too."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    top = max([torch.cuda.max_memory_allocated()] + [int(rec[3] * X) for rec in log])
    return top - before


def _single_rows(torch, cuflash, inputs, g, scales, X: int) -> list:
    """Rows of single-GPU flash_attn_func's peak above its inputs (non-causal): on the local
    inputs (q, k, v, dout) and on the whole sequence of a ring of each of ``scales`` ranks."""
    rows = []
    _, n, h, d = inputs[0].shape
    for scale in sorted({1} | set(scales)):
        if scale == 1:
            sq, sk, sv, sd = inputs
        else:  # the whole sequence of a ring of `scale` ranks
            sq, sk, sv, sd = (torch.randn(1, n * scale, h, d, device="cuda",
                                          dtype=torch.bfloat16, generator=g) for _ in range(4))

        def single():
            leaves = [x.detach().requires_grad_() for x in (sq, sk, sv)]
            o = cuflash.flash_attn_func(*leaves, causal=False)
            torch.autograd.grad(o, leaves, sd)
        single()
        peak = _peak(torch, single)
        rows.append(dict(P=1, causal=False, dkv_home=None, local=n * scale, X_bytes=X,
                         peak_bytes=peak, peak_X=round(peak / X, 3),
                         whole_of_P=scale if scale > 1 else None))
        del sq, sk, sv, sd
    return rows


def _write_rows(rows, out) -> None:
    for r in rows:
        print(json.dumps(r), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


def _print_phases(log, P, causal, name) -> None:
    print(f"phases P={P} causal={causal} variant={name} (live X, peak X since the last record):",
          flush=True)
    print("  " + " | ".join(f"{w} s{s} {a:.2f}/{p:.2f}" for w, s, a, p in log), flush=True)


def simulated_ring(cfd, torch, world: int, rank: int = 0):
    """A stand-in for cuflash.distributed._Ring: rank ``rank`` of a ring of ``world`` in one
    process, every transfer replaced by a buffer allocated on the current stream, as a transfer's
    would be (a K/V block: a copy of the one sent, so that the forward's values stay finite; the
    dK/dV shares: zeros). The ring's buffers, calls and their shapes are those of that rank of a
    real ring; the values are not (nothing is checked)."""
    class SimulatedRing(cfd._Ring):
        def __init__(self, group, device):
            self.group, self.rank, self.world, self.stream = group, rank, world, None
            self.to_global = lambda r: r
            self.next, self.prev = (rank + 1) % world, (rank - 1) % world

        def start(self, tensors, after_current=True, reverse=False, trace=None, peers=None,
                  recv_like=None):
            if recv_like is not None:
                return [torch.zeros(t.shape, dtype=t.dtype, device=t.device)
                        for t in recv_like], []
            return [t.clone() for t in tensors], []

        def finish(self, reqs):
            pass
    return SimulatedRing


def simulate(opts) -> None:
    """--simulate: rank 0 of rings of each given size in this process (simulated_ring), every
    variant's peak above the inputs in units of X, causal and not, and its forward's and
    backward's times (CUDA events, median of 3, the variants alternated); single-GPU
    flash_attn_func on the local positions and, with --whole, on the sequence of each ring size."""
    import random

    import torch
    import torch.distributed as dist

    import cuflash
    from cuflash import distributed as cfd

    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    n, h, d = opts["local"], opts["heads"], 128
    X = n * h * d * 2
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    rows = []
    saved_ring = cfd._Ring
    saved = {f: getattr(cfd, f) for f in VARIANTS["low"]}

    def setup(name):
        for flag, value in VARIANTS[name].items():
            setattr(cfd, flag, value)

    try:
        for P in opts["simulate"]:
            cfd._Ring = simulated_ring(cfd, torch, P)
            for causal in (False, True):
                def run():
                    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                    o = cfd.ring_flash_attn_func(*leaves, causal=causal)
                    torch.autograd.grad(o, leaves, dout)

                def ms():  # (forward, backward)
                    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                    a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                    a.record()
                    o = cfd.ring_flash_attn_func(*leaves, causal=causal)
                    b.record()
                    torch.autograd.grad(o, leaves, dout)
                    c.record()
                    c.synchronize()
                    return a.elapsed_time(b), b.elapsed_time(c)
                times = {name: [] for name in opts["variants"]}
                for name in opts["variants"]:
                    setup(name)
                    run()  # warm-up (compiles)
                    log = []
                    undo = _instrument(cfd, torch, log, X) if opts["phases"] and not causal \
                        else None
                    try:
                        peak = _peak(torch, run, log, X)
                    finally:
                        if undo:
                            undo()
                    rows.append(dict(P=P, causal=causal, variant=name, local=n, X_bytes=X,
                                     peak_bytes=peak, peak_X=round(peak / X, 3), simulated=True))
                    if log:
                        _print_phases(log, P, causal, name)
                for _ in range(3):
                    order = list(times)
                    random.shuffle(order)
                    for name in order:
                        setup(name)
                        times[name].append(ms())
                for r in rows:
                    if r["P"] == P and r["causal"] == causal and r["variant"] in times:
                        for i, key in enumerate(("fwd_ms", "bwd_ms")):
                            r[key] = round(sorted(t[i] for t in times[r["variant"]])[1], 2)
    finally:
        cfd._Ring = saved_ring
        for flag, value in saved.items():
            setattr(cfd, flag, value)
    rows += _single_rows(torch, cuflash, (q, k, v, dout), g,
                         set(opts["simulate"]) if opts["whole"] else set(), X)
    _write_rows(rows, opts["out"])
    dist.destroy_process_group()


def _worker(rank, world, port, opts):
    import torch
    import torch.distributed as dist

    import cuflash
    from cuflash import distributed as cfd

    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank),
                            timeout=datetime.timedelta(seconds=120))
    n, h, d = opts["local"], opts["heads"], 128
    X = n * h * d * 2
    g = torch.Generator(device="cuda").manual_seed(rank)
    q, k, v, dout = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    rows = []
    pair = dist.new_group([0, 1])  # every rank makes it
    saved = {f: getattr(cfd, f) for f in VARIANTS["low"]}
    for P, group in ((world, None), (2, pair)):
        for causal in (False, True):
            for home in opts["variants"]:
                for flag, value in VARIANTS[home].items():
                    setattr(cfd, flag, value)
                if rank < P:
                    def run():
                        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                        o = cfd.ring_flash_attn_func(*leaves, causal=causal, group=group)
                        torch.autograd.grad(o, leaves, dout)
                    run()  # warm-up (compiles, the group's first transfers)
                    log = []
                    undo = _instrument(cfd, torch, log, X) if (
                        opts["phases"] and rank == 0 and not causal) else None
                    try:
                        peak = _peak(torch, run, log, X)
                    finally:
                        if undo:
                            undo()
                    t = torch.tensor([float(peak)], device="cuda")
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                    rows.append(dict(P=P, causal=causal, dkv_home=home, variant=home, local=n, X_bytes=X,
                                     peak_bytes=int(t.item()), peak_X=round(t.item() / X, 3)))
                    if log:
                        _print_phases(log, P, causal, home)
                dist.barrier()
    for flag, value in saved.items():
        setattr(cfd, flag, value)
    if rank == 0:
        rows += _single_rows(torch, cuflash, (q, k, v, dout), g,
                             {2, world} if opts["whole"] else set(), X)
        _write_rows(rows, opts["out"])
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--local", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--phases", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS),
                    default=["low+dq+lazy", "g4"])
    ap.add_argument("--simulate", type=int, nargs="+", default=None, metavar="P",
                    help="one process on one GPU: rank 0 of rings of these sizes, every transfer "
                         "replaced by a copy made on the GPU (simulated_ring: the same buffers, "
                         "wrong values); also the forward's and backward's times per variant")
    ap.add_argument("--whole", action="store_true",
                    help="also single-GPU attention on the whole sequence of a ring of 2 and of "
                         "--procs ranks")
    a = ap.parse_args()
    if a.simulate:
        return simulate(vars(a))
    import torch.multiprocessing as mp

    os.environ.update(NO_MULTICAST)
    mp.spawn(_worker, args=(a.procs, _free_port(), vars(a)), nprocs=a.procs, join=True)


if __name__ == "__main__":
    main()
