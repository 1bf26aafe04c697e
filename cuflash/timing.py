"""One way to time a GPU callable: CUDA events, warm-up, median. Used by the benchmarks
and the tuner alike, so their numbers mean the same thing.

Two regimes, chosen explicitly:

* ``back_to_back=N`` (default 10): each sample times N consecutive calls and divides; the GPU
  runs from a full queue, so the number is the kernels' time, not the host's per-call cost
  (``host_us`` measures that separately). Inputs may stay in L2 between calls.
* ``flush_l2=True``: each sample is a single call preceded by a write of a buffer twice
  the L2 size, so no sample starts with its inputs in L2 (the tuner's regime: a kernel
  that only wins from a warm cache does not win).

Events are recorded on the current CUDA stream (CuPy's and torch's default streams are the
same legacy stream unless either has been told otherwise).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    samples: tuple          # ms per call, one per sample
    back_to_back: int
    flush_l2: bool

    @property
    def spread(self) -> float:
        """(max - min) / median of the samples."""
        return (max(self.samples) - min(self.samples)) / self.median_ms if self.median_ms else 0.0


_flush_buffers: dict = {}


def l2_flusher(device: int = 0) -> Callable[[], None]:
    """A callable that overwrites twice the L2 of ``device`` (one kernel, on the current stream)."""
    import cupy

    buf = _flush_buffers.get(device)
    if buf is None:
        with cupy.cuda.Device(device):
            l2 = int(cupy.cuda.Device(device).attributes.get("L2CacheSize", 50 << 20))
            buf = _flush_buffers[device] = cupy.empty(2 * l2, dtype=cupy.uint8)
    return lambda: buf.fill(1)


def warm_up(fn: Callable[[], object], calls: int = 3, min_s: float = 0.05) -> None:
    """At least ``calls`` calls and ``min_s`` seconds of GPU work: an idle GPU starts at low
    clocks, and a count of calls alone can leave the first samples of a short kernel slow."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    t0, done = time.perf_counter(), 0
    while done < max(1, calls) or time.perf_counter() - t0 < min_s:
        fn()
        done += 1
        if done >= calls:
            stream.synchronize()
        if done > 10000:
            break


def time_ms(fn: Callable[[], object], *, warmup: int = 3, reps: int = 20, back_to_back: int = 10,
            flush_l2: bool = False, timeout_s: Optional[float] = None, device: int = 0) -> Timing:
    """Median milliseconds per call of ``fn()`` by CUDA events (see the module docstring).

    ``flush_l2=True`` forces single-call samples. All samples are queued before one
    synchronization at the end, so the GPU never waits for the host between the events of a
    sample. Raises TimeoutError when one warm call says ``reps`` samples would take longer
    than ``timeout_s`` seconds.
    """
    import cupy

    inner = 1 if flush_l2 else max(1, int(back_to_back))
    flush = l2_flusher(device) if flush_l2 else None
    warm_up(fn, warmup)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    fn()
    end.record()
    end.synchronize()
    one_ms = cupy.cuda.get_elapsed_time(start, end)
    if timeout_s is not None and one_ms / 1e3 * reps * inner > timeout_s:
        raise TimeoutError(f"one call takes {one_ms:.1f} ms: {reps} samples would exceed {timeout_s} s")
    return _sample({"fn": fn}, reps, inner, flush)["fn"]


def time_interleaved(fns: dict, *, warmup: int = 3, reps: int = 20, back_to_back: int = 10,
                     flush_l2: bool = False, device: int = 0, order: str = "shuffle") -> dict:
    """``time_ms`` for several callables with their samples interleaved, so that clock and
    thermal drift hit all of them alike. Returns {name: Timing}.

    ``order`` of the callables within each round of samples (ORDERS):
    * "shuffle" (default): a new permutation every round (seeded: the same run, the same
      orders), so every callable follows every other one about equally often;
    * "rotate": the round's order shifted by one every round (each callable meets every
      position of the round, but keeps its predecessor);
    * "fixed": A B C A B C ...
    Why: back to back, the H100's clock under sustained load depends on what ran just before: a
    fast kernel right after a slow one (lower power: the clock recovered) runs faster. With the
    bench's fixed order SDPA cuDNN always followed the slow SDPA flash row and the cuflash
    forward always followed cuDNN (tests/sm90_fwd_cells_timing.py --order-check measures it; a
    row after a slow row gained up to ~9% at 16k keys there)."""
    inner = 1 if flush_l2 else max(1, int(back_to_back))
    flush = l2_flusher(device) if flush_l2 else None
    for fn in fns.values():
        warm_up(fn, warmup)
    return _sample(fns, reps, inner, flush, order)


ORDERS = ("shuffle", "rotate", "fixed")


def round_orders(names: list, reps: int, order: str = "fixed") -> list:
    """The order of ``names`` in each of ``reps`` rounds (time_interleaved's ``order``)."""
    import random

    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    names = list(names)
    if order == "fixed" or len(names) < 2:
        return [names] * reps
    if order == "rotate":
        return [names[r % len(names):] + names[:r % len(names)] for r in range(reps)]
    rng = random.Random(len(names) * 1000 + reps)
    out = []
    for _ in range(reps):
        perm = names[:]
        rng.shuffle(perm)
        out.append(perm)
    return out


def _sample(fns: dict, reps: int, inner: int, flush, order: str = "fixed") -> dict:
    """{name: Timing}: ``reps`` samples of ``inner`` calls each, interleaved across ``fns`` in
    ``order`` (round_orders), all queued before one synchronization; each Timing's samples in
    sample order."""
    import cupy

    events = {name: [] for name in fns}
    if order is True:            # (the earlier rotate=True)
        order = "rotate"
    elif order is False or order is None:
        order = "fixed"
    for names in round_orders(list(fns), reps, order):
        for name in names:
            fn = fns[name]
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            if flush is not None:
                flush()
            a.record()
            for _ in range(inner):
                fn()
            b.record()
            events[name].append((a, b))
    cupy.cuda.get_current_stream().synchronize()
    out = {}
    for name, evs in events.items():
        samples = tuple(cupy.cuda.get_elapsed_time(a, b) / inner for a, b in evs)
        out[name] = Timing(statistics.median(samples), samples, inner, flush is not None)
    return out


def host_us_interleaved(fns: dict, calls: int = 400, rounds: int = 15,
                        sync: Optional[Callable[[], None]] = None) -> dict:
    """Host microseconds per call of each of ``fns`` ({name: (fn, context)}: ``context()``
    gives a context manager entered around each of its timings; (fn, context, n): n calls per
    round for this fn instead of ``calls``): in ``rounds`` rounds, each round timing ``calls``
    calls of every fn in turn. A shared machine's host speed drifts by tens of percent within
    a minute, so one fn timed after another can be compared with a different machine; in
    rounds each fn meets every phase of the drift. Returns {name: (best, median)} over rounds
    (best: the least disturbed round, the figure to compare)."""
    per = {name: [] for name in fns}
    for name, (fn, context, *n) in fns.items():  # warm-up
        with context():
            for _ in range(max(1, (n[0] if n else calls) // 4)):
                fn()
    for _ in range(rounds):
        for name, (fn, context, *n) in fns.items():
            n = n[0] if n else calls
            if sync is not None:
                sync()
            with context():
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                per[name].append((time.perf_counter() - t0) / n * 1e6)
    if sync is not None:
        sync()
    return {name: (min(v), statistics.median(v)) for name, v in per.items()}


def host_us(fn: Callable[[], object], calls: int = 2000, sync: Optional[Callable[[], None]] = None,
            repeats: int = 5) -> float:
    """Host microseconds per call: CPU clock over ``calls`` calls, best of ``repeats`` (what a
    caller pays before the GPU sees the launch). ``sync`` drains the GPU between repeats."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    if sync is not None:
        sync()
    return best
