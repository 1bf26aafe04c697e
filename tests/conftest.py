import math
import os
import warnings

import numpy as np
import pytest

from cuflash import _gpu

NVCC_ALL_ENV = "CUFLASH_TEST_NVCC_ALL"


def pytest_addoption(parser):
    parser.addoption("--nvcc-all", action="store_true", default=False,
                     help="tests/test_compile.py: build every valid point of every kernel "
                          "family's space for every head dim with nvcc (slow: many minutes), "
                          f"not the default sample; also {NVCC_ALL_ENV}=1")


def nvcc_all(config) -> bool:
    """Whether the full nvcc matrix was asked for (--nvcc-all or CUFLASH_TEST_NVCC_ALL=1)."""
    return bool(config.getoption("--nvcc-all")) or \
        os.environ.get(NVCC_ALL_ENV, "") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    reason = _gpu.why_unavailable()
    if not reason:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class strict_fp:
    """Turn numpy floating point errors and any warning into exceptions (the reference tests:
    `from conftest import strict_fp`)."""

    def __enter__(self):
        self._err = np.errstate(all="raise")
        self._err.__enter__()
        self._warn = warnings.catch_warnings()
        self._warn.__enter__()
        warnings.simplefilter("error")
        return self

    def __exit__(self, *exc):
        self._warn.__exit__(*exc)
        return self._err.__exit__(*exc)


def random_attention_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype=np.float64):
    """Fresh random NumPy (q, k, v, dout) in `dtype` and the seed that made them (the reference
    tests: printed on failure, so a failing draw can be replayed)."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    shape_q, shape_k = (batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_kv, headdim)
    q, k, v = rng.standard_normal(shape_q), rng.standard_normal(shape_k), rng.standard_normal(shape_k)
    dout = rng.standard_normal(shape_q)
    return tuple(x.astype(dtype) for x in (q, k, v, dout)), seed


# ---- shared by the GPU test files (test_flash_fwd_gpu.py, test_flash_bwd_gpu.py) ----------
# The grid every family's heuristic is checked on: ragged, unequal and edge seqlens (a single
# query, one row past a block, s_q != s_k both ways), head dims 32..256 including odd
# multiples of 8 (40, 72: zero-padded up to the next compiled head dim), MHA / GQA / MQA.
GPU_SEQLENS = [(1, 1), (1, 4096), (17, 17), (113, 203), (128, 217), (256, 512), (512, 256),
               (1023, 1024), (1024, 1023), (2049, 2049)]
GPU_HDIMS = [32, 40, 64, 72, 96, 128, 160, 256]
GPU_HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
GPU_DTYPES = ["bf16", "fp16"]
# The small shape every point of a family's space is checked on (ragged in both seqlens, GQA).
SPACE_SHAPE = dict(batch=1, seqlen_q=333, seqlen_k=301, nheads=2, nheads_kv=1)
SPACE_HDIMS = (64, 128)
SPACE_DTYPE = "bf16"


def grid_problem(op, dtype, causal, hdim, seqlens, heads, batch=2, deterministic=False):
    from cuflash.problem import Problem

    (sq, sk), (h, hkv) = seqlens, GPU_HEADS[heads]
    return Problem(op, dtype, batch, sq, sk, h, hkv, hdim, causal, deterministic)


def grid_params(op):
    """pytest params (family, dtype, causal, hdim, seqlens, heads) of the GPU grid, for every
    registered family of ``op``; ids spell them out."""
    from cuflash import registry

    out = []
    for fam in registry.families(op):
        for dtype in GPU_DTYPES:
            for causal in (False, True):
                for hdim in GPU_HDIMS:
                    for seqlens in GPU_SEQLENS:
                        for heads in GPU_HEADS:
                            out.append(pytest.param(
                                fam, dtype, causal, hdim, seqlens, heads,
                                id=f"{fam.name}-{dtype}-{'causal' if causal else 'full'}-d{hdim}-"
                                   f"{seqlens[0]}x{seqlens[1]}-{heads}"))
    return out


def space_configs(op):
    """[(family, config)] of every point of every ``op`` family's space that its own rules
    allow, at SPACE_HDIMS, both masks, SPACE_DTYPE (the device's shared memory is checked in
    the test: it is not known at collection). Families that require a feature of every call
    (``requires``: fa2_fwd_paged runs only paged varlen calls) cannot run this dense problem;
    their own test files cover them."""
    from cuflash import registry
    from cuflash.problem import Problem

    out = []
    for fam in registry.families(op):
        if getattr(fam, "requires", ()):
            continue
        for hdim in SPACE_HDIMS:
            for causal in (False, True):
                p = Problem(op, SPACE_DTYPE, SPACE_SHAPE["batch"], SPACE_SHAPE["seqlen_q"],
                            SPACE_SHAPE["seqlen_k"], SPACE_SHAPE["nheads"], SPACE_SHAPE["nheads_kv"],
                            hdim, causal)
                out += [(fam, cfg) for cfg, why in fam.enumerate(p) if not why]
    return out


def space_params(op):
    """space_configs(op) as pytest params, each with its config's name as id (the family's
    name in front when two families would give one name)."""
    configs = space_configs(op)
    names = [cfg.name for _, cfg in configs]
    return [pytest.param(fam, cfg, id=cfg.name if names.count(cfg.name) == 1 else f"{fam.name}-{cfg.name}")
            for fam, cfg in configs]


def device_heuristic(family, problem, device=0):
    """The family's heuristic for ``problem`` on this GPU, with the call's flags applied; or
    pytest.skip when the family does not support the problem here."""
    from cuflash import _gpu

    arch = _gpu.arch(device)
    why = family.supports(arch, problem)
    if why:
        pytest.skip(f"{family.name}: {why}")
    return family.for_problem(family.heuristic(problem, arch, _gpu.max_smem(device)), problem)


def require_fits_device(config, device=0):
    from cuflash import _gpu

    why = config.problems(_gpu.max_smem(device))
    if why:
        pytest.skip(f"{config.name} does not fit this GPU: {'; '.join(why)}")


@pytest.fixture
def poison_outputs(monkeypatch):
    """cuflash NaN-fills its outputs before each launch, so unwritten elements show."""
    from cuflash import api

    monkeypatch.setattr(api, "POISON_OUTPUTS", True)


def torch_dtype(name):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def cuda_randn(shape, dtype):
    import torch

    return torch.randn(shape, device="cuda", dtype=dtype)


def torch_attention(q, k, v, causal, scale, dtype):
    """Plain attention in torch ops, (out, lse), in `dtype`: float64 is the reference; a 16-bit
    dtype is plain low precision as an unfused model runs it (matmuls in that dtype, softmax
    in fp32). Bottom-right aligned causal mask; fully masked rows give out 0, lse +inf.
    Differentiable (the backward tests take its gradients)."""
    import torch

    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))  # (b, h, s, d)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)).to(torch.float64 if dtype == torch.float64 else torch.float32) * scale
    sq, sk = q.shape[2], k.shape[2]
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        s = s.masked_fill(~keep, -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    lse = torch.where(l[..., 0] > 0, (m + torch.log(l))[..., 0], torch.full_like(l[..., 0], math.inf))
    p = p / torch.where(l > 0, l, torch.ones_like(l))
    return (p.to(dtype) @ v).transpose(1, 2), lse


@pytest.fixture
def count_validation(monkeypatch):
    """Counts api.check_qkv calls (the first-call validation of a shape: "fwd" / "bwd"), with fresh
    repeat-call plan caches (torch's forward and backward, the CuPy backward's)."""
    from cuflash import api, torch_ops

    monkeypatch.setattr(torch_ops, "_fwd_plans", {})
    monkeypatch.setattr(torch_ops, "_bwd_plans", {})
    monkeypatch.setattr(api, "_bwd_plans", {})
    calls = []
    real = api.check_qkv

    def counting(*args, **kwargs):
        calls.append(args[5] if len(args) > 5 else kwargs.get("op", "fwd"))
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "check_qkv", counting)
    return calls


# decode_splitkv's heuristic takes the regs kernel (decode_splitkv_regs) on sm_90 at head dim 128
# (REGS_DEFAULT). The test files that pin options of the older loops (the cp.async loop's and the
# Hopper loop's: their module switches only reach a heuristic that does not take regs) run with it off.
DECODE_OLDER_LOOP_TESTS = frozenset({
    "test_decode_bandwidth_gpu", "test_decode_bulk_gpu", "test_decode_fused_gpu", "test_decode_latency_gpu",
    "test_decode_resident_gpu", "test_decode_ringfill_gpu", "test_decode_stream_gpu", "test_decode_tma_gpu",
    "test_decode_bandwidth_cpu", "test_decode_bulk_cpu", "test_decode_fused_cpu", "test_decode_latency_cpu",
    "test_decode_lean_cpu", "test_decode_ringfill_cpu", "test_decode_stream_cpu", "test_decode_tma_cpu",
    "test_decode_tma_timing_cpu", "test_decode_cpu"})


@pytest.fixture(autouse=True)
def _decode_older_loops(request, monkeypatch):
    if request.module.__name__.rsplit(".", 1)[-1] in DECODE_OLDER_LOOP_TESTS:
        from cuflash.families import decode_splitkv as mod
        monkeypatch.setattr(mod, "REGS_DEFAULT", 0)
