"""--mode decode: flash_attn_with_kvcache bandwidth against SDPA flash and cuDNN on the same K/V.

One new query token per sequence (seqlen_q 1), 32 query heads on 8 KV heads, d 128, bf16, the
cache full to ``ctx`` keys; batch x context over --decode-batches x --decode-ctxs. Impls:
"cuflash" (contiguous cache, num_splits=0), "cuflash_page16" and "cuflash_page256" (paged over a
shuffled block table), "sdpa_flash" and "sdpa_cudnn" (scaled_dot_product_attention with
enable_gqa on (b, h, s, d) views of the same cache). Each impl is timed by CUDA-graph replay:
one graph of 20 calls per impl; the impls of a (batch, ctx) cell replay in shuffled rounds
(cuflash.timing.round_orders, ``reps`` replays per impl spread over ``rounds`` rounds), and ``us`` is the
median replay / 20 over all rounds. The paged caches view the contiguous cache's memory (pages
of one row are its consecutive ``page`` keys, listed in a shuffled block table), so every impl
reads the same bytes. kv_TBps = K + V bytes read (2 · batch · ctx · hk · d · 2) / time.

Why interleaved (session 17): timed one impl after another, with a fresh allocation per page
size, the bench put page 16 at 0.88-0.95x and page 256 at 0.87-0.97x of the contiguous time at
batch >= 8, where tests/decode_tma_timing.py (alternating order, one memory) measured 1.01-1.08x
(the H100's clock under sustained load depends on what ran just before: cuflash.timing).
Interleaved on one memory (session 17 round 3, batch 1 / 8 x 8k / 32k): page 16 1.05-1.10x and
page 256 1.01-1.03x the contiguous time.

Writes results/<gpu>/decode.{json,csv,png}: records {impl, batch, ctx, hq, hk, d, page_size, us,
kv_TBps} (+ error for an impl that could not run), the png plots kv_TBps against ctx per batch.
"""
from __future__ import annotations

from .. import _gpu
from .common import results_dir, short, write_json

STEM = "decode"
BATCHES = (1, 8, 32, 64)
CTXS = (8192, 32768, 65536, 131072)
HQ, HK, D = 32, 8, 128
GRAPH_CALLS = 20
MAX_BYTES = 24 * 2 ** 30  # K + V of one cell (paged copies come on top)


def _cache(batch, ctx, page, dt):
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    if not page:
        kc = torch.randn(batch, ctx, HK, D, device="cuda", dtype=dt, generator=g)
        return kc, torch.randn_like(kc), None
    blocks = -(-ctx // page)
    kc = torch.randn(batch * blocks, page, HK, D, device="cuda", dtype=dt, generator=g)
    perm = torch.randperm(batch * blocks, device="cuda", generator=g).view(batch, blocks)
    return kc, torch.randn_like(kc), perm.to(torch.int32)


def _fn(impl, q, kc, vc, table, seqlens):
    import torch.nn.functional as F

    if impl.startswith("cuflash"):
        from ..decode import flash_attn_with_kvcache

        return lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table)
    from torch.nn.attention import sdpa_kernel

    from .common import sdpa_backend

    backend = sdpa_backend(impl)
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def f():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    return f


def capture_graph(f, calls: int):
    """A CUDA graph of ``calls`` calls of f, captured after a warm-up call on the capture stream
    (workspaces, lazy init) and replayed once."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            f()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph(f, reps: int) -> float:
    """Microseconds per call: a CUDA graph of GRAPH_CALLS calls, the median of reps replays."""
    import torch

    f()
    torch.cuda.synchronize()
    graph = capture_graph(f, GRAPH_CALLS)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    times.sort()
    return times[len(times) // 2]


def paged_view(kc, vc, page: int, gen=None):
    """(k pages, v pages, block_table) viewing the contiguous (batch, ctx, hk, d) caches kc, vc as
    (batch · ctx / page, page, hk, d) pages, with row b's table listing its own pages (b · blocks
    .. (b + 1) · blocks - 1) in a shuffled order. A paged call then reads the very bytes of the
    contiguous one, keys in another order (one query row: the output does not depend on the
    order but for rounding). ctx must be a multiple of page."""
    import torch

    batch, ctx = kc.shape[0], kc.shape[1]
    if ctx % page:
        raise ValueError(f"page: the context {ctx} must be a multiple of the page size {page}")
    blocks = ctx // page
    perm = torch.stack([torch.randperm(blocks, device=kc.device, generator=gen) for _ in range(batch)])
    table = (perm + torch.arange(batch, device=kc.device)[:, None] * blocks).to(torch.int32)
    return (kc.reshape(batch * blocks, page, *kc.shape[2:]), vc.reshape(batch * blocks, page, *vc.shape[2:]),
            table)


def run(batches=BATCHES, ctxs=CTXS, reps: int = 10, out="results", pages=(16, 256), log=print,
        rounds: int = 5) -> list:
    import torch

    from ..timing import round_orders

    _gpu.require("bench --mode decode")
    dt = torch.bfloat16
    records = []
    for batch in batches:
        for ctx in ctxs:
            kv_bytes = 2 * batch * ctx * HK * D * 2
            if kv_bytes > MAX_BYTES:
                log(f"skip batch {batch} x ctx {ctx}: {kv_bytes / 2**30:.0f} GiB of K/V")
                continue
            q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=dt)
            seqlens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            try:
                kc, vc, _ = _cache(batch, ctx, 0, dt)
            except torch.OutOfMemoryError as exc:
                log(f"batch {batch} ctx {ctx}: {short(exc)}")
                continue
            caches = {0: (kc, vc, None)}
            caches.update({page: None for page in pages})   # paged views of the same memory
            impls = [("cuflash", 0), ("sdpa_flash", 0), ("sdpa_cudnn", 0)] + [(f"cuflash_page{p}", p) for p in pages]
            recs, graphs = {}, {}
            for impl, page in impls:
                recs[impl] = dict(impl=impl, batch=batch, ctx=ctx, hq=HQ, hk=HK, d=D, page_size=page)
            for impl, page in impls:
                try:
                    if page and caches[page] is None:
                        caches[page] = paged_view(kc, vc, page)
                    ck, cv, table = caches[page]
                    f = _fn(impl, q, ck, cv, table, seqlens)
                    graphs[impl] = capture_graph(f, GRAPH_CALLS)
                except Exception as exc:  # noqa: BLE001 - a record says why
                    recs[impl].update(us=None, kv_TBps=None, error=short(exc))
                    log(f"{impl:16s} b{batch:<3d} ctx {ctx:>6d}: {short(exc)}")
            samples = {name: [] for name in graphs}
            for order in round_orders(list(graphs), rounds, "shuffle"):
                for name in order:
                    for _ in range(-(-reps // rounds)):   # reps replays in all, over the rounds
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        graphs[name].replay()
                        end.record()
                        end.synchronize()
                        samples[name].append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
            for impl, page in impls:
                rec = recs[impl]
                if impl in samples and samples[impl]:
                    t = sorted(samples[impl])
                    us = t[len(t) // 2]
                    rec.update(us=us, kv_TBps=kv_bytes / (us * 1e-6) / 1e12)
                    log(f"{impl:16s} b{batch:<3d} ctx {ctx:>6d}: {us:9.1f} us  {rec['kv_TBps']:.2f} TB/s")
                records.append(rec)
            del kc, vc, caches, graphs
            torch.cuda.empty_cache()
    path = results_dir(out)
    write_json(path / f"{STEM}.json", records)
    _csv(records, path / f"{STEM}.csv")
    plot(records, path / f"{STEM}.png")
    log(f"wrote {path / STEM}.json, .csv, .png")
    return records


def _csv(records, path) -> None:
    import csv

    keys = list(dict.fromkeys(k for r in records for k in r))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(records)


def plot(records: list, path) -> bool:
    """kv_TBps against ctx, one panel per batch, one line per impl."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    batches = sorted({r["batch"] for r in records})
    if not batches:
        return False
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for impl in dict.fromkeys(r["impl"] for r in records):
            pts = sorted((r["ctx"], r["kv_TBps"]) for r in records
                         if r["batch"] == batch and r["impl"] == impl and r.get("kv_TBps"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context (keys)")
        ax.set_ylabel("K+V TB/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"decode, {HQ}:{HK} heads, d {D}, bf16 (CUDA-graph timing)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


__all__ = ["run", "plot", "time_graph", "capture_graph", "BATCHES", "CTXS"]
