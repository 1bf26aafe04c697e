"""Measuring one config on the GPU: compile, verify, time. The ``measure`` the tuner uses.

One runner per *op* (``RUNNERS``), not per family: a runner calls the public API with an
explicit ``config=`` (``flash_attn_func`` / ``flash_attn_backward`` on CuPy arrays), so any
registered family of that op is measured the same way, through the same launch path users
get. For each config, in this order (a failed step ends the trial, recorded and pruned):

1. compile: ``cuflash.compile.get_kernels`` (every role of the family's module; seconds,
   and the main kernel's registers and local memory kept);
2. verify: run it on fresh random inputs of an odd size and compare with the float64
   ``cuflash.reference`` answer; the error must be within 2x the error of plain attention
   in the same low precision (3x for gradients: the FlashAttention test rule). Steps 1-2
   are done once per config and process, whatever the problem size;
3. time: on the problem's benchmark shape with ``cuflash.timing.time_ms``, in one of two
   modes (``TIMING_MODES``; the median of ``reps`` samples is the result):
   * ``"bench"`` (the default): each sample times consecutive calls, as ``python -m cuflash
     bench`` and a training loop run them, inputs possibly warm in L2: the bench's
     ``BENCH_BACK_TO_BACK`` calls, fewer (at least 2) for calls whose 10 would take more than
     ``BENCH_SAMPLE_MS`` (``bench_calls``: from 2 calls on one call's tail overlaps the next
     one's start; more only lengthen the run: a 16k backward takes ~12 ms);
   * ``"flush"``: each sample is one call preceded by a write of twice the L2 size (no sample
     starts with the inputs in L2).
   Why bench by default, for every family: the tuned table is judged by the bench, and the
   two regimes disagreed on the H100 by up to 5% and in their ranking (session 15's
   tests/sm90_fwd_nc_timing.py: sm90_fwd d128 16k, flushed, ranked rescale_first and no
   pingpong above the heuristic, back to back below it; the dynamic scheduler lost 3-6%
   flushed where it tied back to back: a single call pays its ramp and its tail alone, a
   stream of calls overlaps one call's tail with the next one's start).
   ``compare`` re-times a few configs interleaved, in a new order every round (clock drift
   along a study otherwise favours whichever config ran in a cooler phase): the
   study's margin check uses it (tuning/study.py).

Timeouts are soft: a config whose estimated timing run exceeds ``timeout_s`` is stopped
and recorded (a kernel that never returns cannot be interrupted from Python). After a
launch failure the CUDA context is checked; if it is unusable (a sticky error),
``fatal`` says why and the study stops instead of recording every later config as broken.
"""
from __future__ import annotations

import datetime
import time
from typing import Optional

import numpy as np

from .objective import (COMPILE_ERROR, ERROR, LAUNCH_ERROR, OK, SKIPPED, TIMEOUT, WRONG,
                        TrialResult)

# Verification shape: odd lengths so every tile has a ragged edge, seqlen_q != seqlen_k
# (bottom-right causal alignment), GQA (dK, dV summed over a K/V head's query heads).
VERIFY_SHAPE = dict(batch=2, seqlen_q=257, seqlen_k=301, nheads=4, nheads_kv=2)
# Timing modes (see the module doc); the bench's back-to-back count (cuflash.bench: time_interleaved).
TIMING_MODES = ("bench", "flush")
BENCH_BACK_TO_BACK = 10
BENCH_SAMPLE_MS = 25.0


def bench_calls(call_ms: float) -> int:
    """Back-to-back calls per sample in the "bench" mode for a call of ``call_ms``: the bench's
    BENCH_BACK_TO_BACK, fewer (>= 2) where those would exceed BENCH_SAMPLE_MS."""
    if call_ms <= 0:
        return BENCH_BACK_TO_BACK
    return max(2, min(BENCH_BACK_TO_BACK, int(BENCH_SAMPLE_MS // call_ms)))

FWD_FACTOR = 2.0      # FlashAttention rule: error <= 2x plain low precision (forward)
GRAD_FACTOR = 3.0     # ... 3x for gradients


def np_dtype(dtype: str):
    if dtype == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16)


def _is_cuda_error(exc: BaseException) -> bool:
    name = type(exc).__name__
    return "CUDA" in name or "Driver" in name or "cuda" in type(exc).__module__


def _qkv_shapes(problem, head_dim: Optional[int] = None, verify: bool = False):
    d = problem.head_dim if head_dim is None else head_dim
    if verify:
        s = VERIFY_SHAPE
        return ((s["batch"], s["seqlen_q"], s["nheads"], d), (s["batch"], s["seqlen_k"], s["nheads_kv"], d))
    p = problem
    return (p.batch, p.seqlen_q, p.nheads, d), (p.batch, p.seqlen_k, p.nheads_kv, d)


# ---------------------------------------------------------------------------------------
# runners: what "run this config" means for each op (any family of it)

class FwdRunner:
    """op fwd: ``flash_attn_func(q, k, v, causal=..., config=cfg)`` on CuPy arrays."""

    op = "fwd"

    def verify(self, config, problem, rng) -> tuple[bool, str, dict]:
        import cupy

        from cuflash import flash_attn_func, reference

        dt = np_dtype(problem.dtype)
        causal = problem.causal
        shape_q, shape_k = _qkv_shapes(problem, config.head_dim, verify=True)
        q = rng.standard_normal(shape_q).astype(dt)
        k, v = (rng.standard_normal(shape_k).astype(dt) for _ in range(2))
        out, lse, _ = flash_attn_func(*(cupy.asarray(x) for x in (q, k, v)), causal=causal,
                                      config=config, return_attn_probs=True)
        out, lse = cupy.asnumpy(out).astype(np.float64), cupy.asnumpy(lse)
        ref, ref_lse = reference.attention_naive(q, k, v, causal=causal, return_lse=True)
        low = reference.lowp_attention(q, k, v, causal=causal, dtype=dt)
        err, base = float(np.nanmax(np.abs(out - ref))), float(np.abs(low - ref).max())
        if np.isnan(out).any():
            err = float("inf")
        finite = np.isfinite(ref_lse)
        lse_ok = np.array_equal(np.isfinite(lse), finite) and (
            not finite.any() or np.abs(lse[finite] - ref_lse[finite]).max() < 1e-3)
        facts = {"max_err": err, "lowp_err": base}
        ok = err <= FWD_FACTOR * base + 1e-5 and lse_ok
        detail = (f"max|O - ref| {err:.3g} vs plain {problem.dtype} {base:.3g}"
                  + ("" if lse_ok else ", LSE wrong"))
        return ok, detail, facts

    def prepare(self, problem, rng_seed: int) -> dict:
        import cupy

        dt = np_dtype(problem.dtype)
        rs = cupy.random.RandomState(rng_seed)
        shape_q, shape_k = _qkv_shapes(problem)
        return {"q": rs.standard_normal(shape_q, dtype=cupy.float32).astype(dt),
                "k": rs.standard_normal(shape_k, dtype=cupy.float32).astype(dt),
                "v": rs.standard_normal(shape_k, dtype=cupy.float32).astype(dt)}

    def call(self, config, problem, inputs: dict):
        from cuflash import flash_attn_func

        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        return lambda: flash_attn_func(q, k, v, causal=problem.causal, config=config)


class BwdRunner:
    """op bwd: ``flash_attn_backward(dout, q, k, v, out, lse, causal=..., config=cfg)``; out
    and lse from the forward in force (tuned or heuristic)."""

    op = "bwd"

    def verify(self, config, problem, rng) -> tuple[bool, str, dict]:
        import cupy

        from cuflash import flash_attn_backward, flash_attn_func, reference

        dt = np_dtype(problem.dtype)
        causal = problem.causal
        shape_q, shape_k = _qkv_shapes(problem, config.head_dim, verify=True)
        q, dout = (rng.standard_normal(shape_q).astype(dt) for _ in range(2))
        k, v = (rng.standard_normal(shape_k).astype(dt) for _ in range(2))
        gq, gk, gv, gdo = (cupy.asarray(x) for x in (q, k, v, dout))
        out, lse, _ = flash_attn_func(gq, gk, gv, causal=causal, return_attn_probs=True)
        grads = flash_attn_backward(gdo, gq, gk, gv, out, lse, causal=causal,
                                    deterministic=problem.deterministic, config=config)
        got = [cupy.asnumpy(g).astype(np.float64) for g in grads]
        ref = reference.attention_backward_naive(dout, q, k, v, causal=causal)
        low = reference.attention_grad_lowp(dout, q, k, v, causal=causal, dtype=dt)
        facts, bad = {}, []
        for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
            err = float("inf") if np.isnan(g).any() else float(np.abs(g - r).max())
            base = float(np.abs(lo - r).max())
            facts[f"{name}_err"], facts[f"{name}_lowp_err"] = err, base
            if not err <= GRAD_FACTOR * base + 1e-4:
                bad.append(f"{name} {err:.3g} vs plain {base:.3g}")
        detail = "; ".join(bad) or "dq, dk, dv within 3x plain low-precision error"
        return not bad, detail, facts

    def prepare(self, problem, rng_seed: int) -> dict:
        import cupy

        from cuflash import flash_attn_func

        inputs = FwdRunner().prepare(problem, rng_seed)
        rs = cupy.random.RandomState(rng_seed + 1)
        inputs["dout"] = rs.standard_normal(inputs["q"].shape, dtype=cupy.float32).astype(inputs["q"].dtype)
        inputs["out"], inputs["lse"], _ = flash_attn_func(inputs["q"], inputs["k"], inputs["v"],
                                                          causal=problem.causal, return_attn_probs=True)
        return inputs

    def call(self, config, problem, inputs: dict):
        from cuflash import flash_attn_backward

        i = inputs
        return lambda: flash_attn_backward(i["dout"], i["q"], i["k"], i["v"], i["out"], i["lse"],
                                           causal=problem.causal,
                                           deterministic=problem.deterministic, config=config)


class DecodeRunner:
    """op decode: ``cuflash.decode.kvcache_with_config(cfg, q, k_cache, v_cache, cache_seqlens=...)``
    on torch CUDA tensors (the decode path takes torch only): the cache full to seqlen_k keys
    per row, num_splits=0 (the config's split rule)."""

    op = "decode"

    def verify(self, config, problem, rng) -> tuple[bool, str, dict]:
        import torch

        from cuflash import reference
        from cuflash.decode import kvcache_with_config

        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[problem.dtype]
        d = problem.head_dim
        lens = np.array([777, 1, 2049], np.int32)
        q = torch.from_numpy(rng.standard_normal((3, 2, 8, d))).to("cuda", dt)
        kc = torch.from_numpy(rng.standard_normal((3, 2100, 2, d))).to("cuda", dt)
        vc = torch.from_numpy(rng.standard_normal((3, 2100, 2, d))).to("cuda", dt)
        seqlens = torch.from_numpy(lens).cuda()
        out, lse = kvcache_with_config(config, q, kc, vc, cache_seqlens=seqlens,
                                       causal=problem.causal)
        as64 = lambda x: x.double().cpu().numpy()  # noqa: E731
        ref, ref_lse, _, _ = reference.attention_kvcache(as64(q), as64(kc), as64(vc), lens,
                                                         causal=problem.causal)
        err = float("inf") if torch.isnan(out).any() else float(np.abs(as64(out) - ref).max())
        fin = np.isfinite(ref_lse)
        lse_err = float(np.abs(lse.cpu().numpy()[fin] - ref_lse[fin]).max()) if fin.any() else 0.0
        ok = err < (2e-2 if problem.dtype == "bf16" else 4e-3) and lse_err < 1e-2
        return ok, f"max|O - ref| {err:.3g}, max|LSE - ref| {lse_err:.3g}", {"max_err": err,
                                                                            "lse_err": lse_err}

    def prepare(self, problem, rng_seed: int) -> dict:
        import torch

        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[problem.dtype]
        g = torch.Generator(device="cuda").manual_seed(rng_seed)
        p = problem
        shape_k = (p.batch, p.seqlen_k, p.nheads_kv, p.head_dim)
        return {"q": torch.randn(p.batch, p.seqlen_q, p.nheads, p.head_dim, device="cuda",
                                 dtype=dt, generator=g),
                "k_cache": torch.randn(*shape_k, device="cuda", dtype=dt, generator=g),
                "v_cache": torch.randn(*shape_k, device="cuda", dtype=dt, generator=g),
                "cache_seqlens": torch.full((p.batch,), p.seqlen_k, dtype=torch.int32, device="cuda")}

    def call(self, config, problem, inputs: dict):
        from cuflash.decode import kvcache_with_config

        i = inputs
        return lambda: kvcache_with_config(config, i["q"], i["k_cache"], i["v_cache"],
                                           cache_seqlens=i["cache_seqlens"], causal=problem.causal)


class Fp8FwdRunner:
    """op fwd in e4m3 (sm90_fwd_fp8): ``flash_attn_func(q8, k8, v8, causal=..., config=cfg,
    q_descale=..., k_descale=..., v_descale=...)`` on CuPy uint8 arrays of e4m3 bytes with fp32
    descales, the API's FP8 route (the prepare and main kernels, as users get them). Verified
    with ``cuflash.fp8.error_ok`` (the GPU tests' rule: 2x plain attention from the same e4m3
    inputs with P rounded to e4m3 as the kernel does) against ``reference_fp8``, with descales
    per (batch, kv head); timed with per-tensor descales 1 on random e4m3 inputs."""

    op = "fwd"
    dtype = "e4m3"

    def verify(self, config, problem, rng) -> tuple[bool, str, dict]:
        import cupy

        from cuflash import flash_attn_func, fp8

        causal = problem.causal
        shape_q, shape_k = _qkv_shapes(problem, config.head_dim, verify=True)
        q8, k8, v8 = (fp8.quantize_e4m3(rng.standard_normal(s) * 3) for s in (shape_q, shape_k, shape_k))
        b, hkv = shape_k[0], shape_k[2]
        qd, kd, vd = (rng.uniform(0.5, 1.5, (b, hkv)).astype(np.float32) for _ in range(3))
        out, lse, _ = flash_attn_func(*(cupy.asarray(x) for x in (q8, k8, v8)), causal=causal,
                                      config=config, q_descale=cupy.asarray(qd),
                                      k_descale=cupy.asarray(kd), v_descale=cupy.asarray(vd),
                                      return_attn_probs=True)
        bits = cupy.asnumpy(out).astype(np.uint32) << 16            # bf16 bits -> fp32
        out, lse = bits.view(np.float32).astype(np.float64), cupy.asnumpy(lse)
        ref, ref_lse = fp8.reference_fp8(q8, k8, v8, qd, kd, vd, causal=causal)
        base = fp8.lowp_fp8_attention(q8, k8, v8, qd, kd, vd, causal=causal)
        if np.isnan(out).any():
            ok, err, base_err = False, float("inf"), float(np.abs(base - ref).max())
        else:
            ok, err, base_err = fp8.error_ok(out, ref, base)
        finite = np.isfinite(ref_lse)
        lse_ok = np.array_equal(np.isfinite(lse), finite) and (
            not finite.any() or np.abs(lse[finite] - ref_lse[finite]).max()
            < 1e-3 * max(1.0, np.abs(ref_lse[finite]).max()))
        facts = {"max_err": err, "lowp_err": base_err}
        detail = (f"max|O - ref| {err:.3g} vs plain e4m3 {base_err:.3g}"
                  + ("" if lse_ok else ", LSE wrong"))
        return ok and lse_ok, detail, facts

    def prepare(self, problem, rng_seed: int) -> dict:
        """Random e4m3 q, k, v on the GPU (bytes drawn from a table of rounded normals: no host
        pass over the benchmark-size tensors), per-tensor descales 1."""
        import cupy

        from cuflash import fp8

        table = cupy.asarray(fp8.quantize_e4m3(np.random.default_rng(rng_seed).standard_normal(1 << 16) * 3))
        rs = cupy.random.RandomState(rng_seed)
        shape_q, shape_k = _qkv_shapes(problem)
        draw = lambda shape: table[rs.randint(0, 1 << 16, size=shape, dtype=cupy.int32)]  # noqa: E731
        return {"q": draw(shape_q), "k": draw(shape_k), "v": draw(shape_k),
                "one": cupy.ones(1, dtype=cupy.float32)}

    def call(self, config, problem, inputs: dict):
        from cuflash import flash_attn_func

        q, k, v, one = inputs["q"], inputs["k"], inputs["v"], inputs["one"]
        return lambda: flash_attn_func(q, k, v, causal=problem.causal, config=config,
                                       q_descale=one, k_descale=one, v_descale=one)


RUNNERS = {"fwd": FwdRunner, "bwd": BwdRunner, "decode": DecodeRunner}
# runners of an op for input dtypes the op's default runner does not make (FP8)
DTYPE_RUNNERS = {("fwd", "e4m3"): Fp8FwdRunner}


def runner_for(op: str, dtype: Optional[str] = None):
    if (op, dtype) in DTYPE_RUNNERS:
        return DTYPE_RUNNERS[(op, dtype)]()
    if dtype is not None and dtype not in ("bf16", "fp16"):
        raise LookupError(f"the tuner has no runner for op {op!r} in dtype {dtype!r} "
                          f"(tuning/measure.py DTYPE_RUNNERS: {sorted(DTYPE_RUNNERS)})")
    try:
        return RUNNERS[op]()
    except KeyError:
        raise LookupError(f"the tuner has no runner for op {op!r} (tuning/measure.py RUNNERS: "
                          f"{sorted(RUNNERS)})") from None


# ---------------------------------------------------------------------------------------

class GpuMeasure:
    """``measure(config) -> TrialResult`` on one GPU for one family and benchmark problem
    (see the module doc).

    Compile and verification results are shared by every GpuMeasure of the process
    (they do not depend on the problem size).
    """

    _checked: dict = {}   # (config, device, kernel dir) -> TrialResult of compile + verify

    def __init__(self, family, problem, device: int = 0, *, reps: int = 20,
                 warmup: int = 3, timeout_s: float = 60.0, verify: bool = True,
                 seed: Optional[int] = None, timing: str = "bench"):
        if timing not in TIMING_MODES:
            raise ValueError(f"timing must be one of {TIMING_MODES}, got {timing!r}")
        self.family, self.problem, self.device = family, problem, device
        self.timing = timing
        self.reps, self.warmup, self.timeout_s, self.verify = reps, warmup, timeout_s, verify
        self.seed = int(np.random.SeedSequence(seed).generate_state(1)[0]) if seed is None else seed
        self.runner = runner_for(family.op, problem.dtype)
        self.fatal = ""
        self._inputs = None

    # -- steps -------------------------------------------------------------------------
    def _compile_and_verify(self, config) -> TrialResult:
        from cuflash.compile import get_kernels, kernel_dir

        key = (config, self.device, str(kernel_dir()))
        if key in self._checked:
            hit = self._checked[key]
            return TrialResult(hit.status, None, hit.reason, None, dict(hit.extra, compiled_before=True))
        t0 = time.perf_counter()
        try:
            kernels = get_kernels(config, self.device)  # the whole module: every role
        except Exception as exc:  # noqa: BLE001 - NVRTC errors come in several classes
            res = TrialResult(COMPILE_ERROR, reason=f"{exc.__class__.__name__}: {exc}"[:4000],
                              compile_s=time.perf_counter() - t0)
            self._checked[key] = res
            return res
        compile_s = time.perf_counter() - t0
        extra = {}
        try:
            attrs = kernels["main"].attributes
            extra = {"registers": int(attrs["num_regs"]), "local_bytes": int(attrs["local_size_bytes"])}
        except Exception:  # noqa: BLE001 - attributes are informative only
            pass
        res = TrialResult(OK, compile_s=compile_s, extra=extra)
        if self.verify:
            try:
                ok, detail, facts = self.runner.verify(config, self.problem,
                                                       np.random.default_rng(self.seed))
            except Exception as exc:  # noqa: BLE001
                return self._failed(config, exc, "verification", compile_s, extra)
            res.extra.update(facts)
            if not ok:
                res.status, res.reason = WRONG, detail
        self._checked[key] = res
        return res

    def _failed(self, config, exc, during: str, compile_s=None, extra=None) -> TrialResult:
        status = LAUNCH_ERROR if _is_cuda_error(exc) else ERROR
        res = TrialResult(status, reason=f"{during}: {exc.__class__.__name__}: {exc}"[:4000],
                          compile_s=compile_s, extra=dict(extra or {}))
        if status == LAUNCH_ERROR:
            self._check_context(exc)
        return res

    def _check_context(self, exc) -> None:
        import cupy

        try:
            cupy.cuda.Device(self.device).synchronize()
            cupy.zeros(1).sum().item()
        except Exception as again:  # noqa: BLE001
            self.fatal = (f"the CUDA context is unusable after {exc.__class__.__name__}: {exc} "
                          f"({again.__class__.__name__}); restart the tune command to go on")

    # -- the measure -------------------------------------------------------------------
    def __call__(self, config) -> TrialResult:
        import cupy

        from cuflash.timing import _sample, time_ms

        if self.fatal:
            return TrialResult(SKIPPED, reason=self.fatal)
        with cupy.cuda.Device(self.device):
            res = self._compile_and_verify(config)
            if res.status != OK:
                return res
            try:
                if self._inputs is None:
                    self._inputs = self.runner.prepare(self.problem, self.seed)
                fn = self.runner.call(config, self.problem, self._inputs)
                if self.timing == "flush":
                    timing = time_ms(fn, warmup=self.warmup, reps=self.reps, flush_l2=True,
                                     timeout_s=self.timeout_s, device=self.device)
                else:   # a one-call probe (after the warm-up) sizes the samples
                    probe = time_ms(fn, warmup=self.warmup, reps=1, back_to_back=1,
                                    timeout_s=self.timeout_s, device=self.device)
                    inner = bench_calls(probe.median_ms)
                    if probe.median_ms / 1e3 * self.reps * inner > self.timeout_s:
                        raise TimeoutError(f"one call takes {probe.median_ms:.1f} ms: {self.reps} samples "
                                           f"of {inner} would exceed {self.timeout_s} s")
                    timing = _sample({"fn": fn}, self.reps, inner, None)["fn"]
            except TimeoutError as exc:
                return TrialResult(TIMEOUT, reason=str(exc), compile_s=res.compile_s, extra=res.extra)
            except Exception as exc:  # noqa: BLE001
                return self._failed(config, exc, "timing", res.compile_s, res.extra)
        samples = timing.samples
        extra = dict(res.extra, reps=len(samples), min_ms=min(samples), max_ms=max(samples),
                     timing=self.timing, back_to_back=timing.back_to_back)
        return TrialResult(OK, timing.median_ms, compile_s=res.compile_s, extra=extra)

    def compare(self, configs, reps: Optional[int] = None) -> dict:
        """{config: median ms} of ``configs`` (already measured OK by this measure) timed together
        in this measure's mode: their samples interleaved in a new order every round
        (cuflash.timing.round_orders' shuffle), so clock drift hits them alike. {} when it cannot (a failure is not recorded: the
        study keeps its own times)."""
        import cupy

        from cuflash.timing import _sample, l2_flusher, warm_up

        configs = list(dict.fromkeys(configs))
        if self.fatal or len(configs) < 2 or self._inputs is None:
            return {}
        reps = self.reps if reps is None else reps
        flush = l2_flusher(self.device) if self.timing == "flush" else None
        try:
            with cupy.cuda.Device(self.device):
                fns = {c: self.runner.call(c, self.problem, self._inputs) for c in configs}
                for fn in fns.values():
                    warm_up(fn, self.warmup)
                probe = _sample(fns, 1, 1, None)
                inner = 1 if flush is not None else bench_calls(
                    max(t.median_ms for t in probe.values()))
                got = _sample(fns, reps, inner, flush, "shuffle")
        except Exception as exc:  # noqa: BLE001
            if _is_cuda_error(exc):
                self._check_context(exc)
            return {}
        return {c: t.median_ms for c, t in got.items()}


def env_record(family, device: int = 0) -> dict:
    """Where and with what a result was measured (Kernel Tuner's ``env``): the device, its
    compute capability, driver, CUDA, NVRTC, CuPy, optuna and cuflash versions, the family,
    its version and its kernel code hash (the stamp of the tuned entry)."""
    import cuflash
    from cuflash import _gpu
    from cuflash.select import current_stamp

    stamp = current_stamp(family)
    env = {"op": family.op, "family": family.name, "family_version": stamp["version"],
           "code_hash": stamp["code_hash"], "cuflash": cuflash.__version__, "device": device,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    probes = {
        "gpu": lambda: _gpu.name(device),
        "cc": lambda: "%d.%d" % _gpu.arch(device),
        "driver": _driver_version,
        "driver_cuda": lambda: _cuda_version(__import__("cupy").cuda.runtime.driverGetVersion()),
        "cuda_runtime": lambda: _cuda_version(__import__("cupy").cuda.runtime.runtimeGetVersion()),
        "nvrtc": lambda: "%d.%d" % __import__("cupy").cuda.nvrtc.getVersion(),
        "cupy": lambda: __import__("cupy").__version__,
        "optuna": lambda: __import__("optuna").__version__,
    }
    for name, probe in probes.items():
        try:
            env[name] = probe()
        except Exception as exc:  # noqa: BLE001 - the record says what it could not learn
            env[name] = f"unknown ({exc.__class__.__name__})"
    return env


def _driver_version() -> str:
    """The NVIDIA driver release (e.g. 580.159.04), from the kernel module on Linux."""
    import re

    with open("/proc/driver/nvidia/version") as fh:
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", fh.read())
    if not m:
        raise ValueError("no version in /proc/driver/nvidia/version")
    return m.group(1)


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


__all__ = ["GpuMeasure", "TIMING_MODES", "BENCH_BACK_TO_BACK", "BENCH_SAMPLE_MS", "bench_calls", "FwdRunner", "BwdRunner", "Fp8FwdRunner", "RUNNERS", "DTYPE_RUNNERS",
           "runner_for", "env_record",
           "VERIFY_SHAPE"]
