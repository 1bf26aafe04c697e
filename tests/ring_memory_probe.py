"""Peak memory of the ring per GPU, in units of X = one local (batch, seqlen/P, heads, d) bf16
tensor, and where it is reached (not a test; a GPU diagnostic for the memory model of
cuflash.distributed, issue 15).

    python tests/ring_memory_probe.py [--local 32768] [--heads 8] [--procs 4]

One spawn of --procs processes; rings of P = procs and P = 2 (the first two ranks), every
rank holding --local positions (so X is the same for every P), causal (zigzag) and not, with the
backward's memory flags of VARIANTS (--variants: some of them): "low" (BWD_LOW_MEMORY, session
18's default), "low+dq" (DQ_IN_WORKSPACE too), "low+dq+lazy" (and HOME_LAZY_FP32: the defaults
since session 19), "travel" (an fp32 accumulator travelling with each block). For each: the peak
of one autograd forward + backward above the inputs (q, k, v, dout: 4 X), as bench --mode ring
counts it, and single-GPU flash_attn_func on the same --local positions (its peak above its
inputs) and, with --whole, on P x --local positions (the sequence a ring of P ranks splits; in
units of the ring's X: what a ring's peak is to be 1/P of). With --phases, rank 0 also prints
live memory (X) after every block call and transfer start, and the peak since the previous
record, for P = procs and P = 2 non-causal: which buffers are live at the peak.
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
VARIANTS = {
    "travel": dict(DKV_HOME=False, BWD_LOW_MEMORY=False, DQ_IN_WORKSPACE=False, HOME_LAZY_FP32=False),
    "low": dict(DKV_HOME=False, BWD_LOW_MEMORY=True, DQ_IN_WORKSPACE=False, HOME_LAZY_FP32=False),
    "low+dq": dict(DKV_HOME=False, BWD_LOW_MEMORY=True, DQ_IN_WORKSPACE=True, HOME_LAZY_FP32=False),
    "low+dq+lazy": dict(DKV_HOME=False, BWD_LOW_MEMORY=True, DQ_IN_WORKSPACE=True,
                        HOME_LAZY_FP32=True),
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
                        print(f"phases P={P} causal={causal} variant={home} (live X, peak X "
                              "since the last record):", flush=True)
                        print("  " + " | ".join(f"{w} s{s} {a:.2f}/{p:.2f}" for w, s, a, p in log),
                              flush=True)
                dist.barrier()
    for flag, value in saved.items():
        setattr(cfd, flag, value)
    if rank == 0:
        for scale in sorted({1} | ({2, world} if opts["whole"] else set())):
            if scale == 1:
                sq, sk, sv, sd = q, k, v, dout
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
        for r in rows:
            print(json.dumps(r), flush=True)
        if opts["out"]:
            with open(opts["out"], "w") as f:
                json.dump(rows, f, indent=1)
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
                    default=["low", "low+dq", "low+dq+lazy"])
    ap.add_argument("--whole", action="store_true",
                    help="also single-GPU attention on the whole sequence of a ring of 2 and of "
                         "--procs ranks")
    a = ap.parse_args()
    import torch.multiprocessing as mp

    os.environ.update(NO_MULTICAST)
    mp.spawn(_worker, args=(a.procs, _free_port(), vars(a)), nprocs=a.procs, join=True)


if __name__ == "__main__":
    main()
