"""Edge shapes for compute-sanitizer (memcheck, racecheck): run under it, not under pytest.

    compute-sanitizer --tool memcheck python tests/gpu_sanitize.py [--families fa2_fwd sm90_fwd ...]

--families: only these kernel families (default: every registered one; the default-selection
run at the end happens only without the option).

Every registered kernel family runs, forced with config= / bwd_config=: each forward
family's heuristic, and each backward family's heuristic (preprocess, main kernel, dQ
epilogue, GQA reduction, through torch autograd) in every key-group layout its space offers
(fa2_bwd: qsplit 1 and 2; sm90_fwd: persistent off and on) and in deterministic mode.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _gpu, registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, hdim, causal)
    (1, 1, 1, 2, 2, 64, False), (1, 17, 113, 4, 1, 40, True), (2, 203, 113, 4, 2, 128, True),
    (1, 113, 203, 2, 2, 256, False), (1, 130, 130, 2, 1, 96, True), (1, 1, 300, 2, 2, 128, True),
    (1, 300, 1, 2, 2, 72, True), (1, 129, 65, 2, 1, 160, False),
    (1, 1100, 900, 16, 4, 64, True),   # more tiles than SMs: a persistent CTA takes several
    (1, 203, 113, 4, 2, 256, True),    # FP8 (head dims multiples of 16 only): d256, ragged, GQA
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def heuristic(family, problem):
    """The family's heuristic for the problem on this GPU, or None where unsupported."""
    arch = _gpu.arch()
    if family.supports(arch, problem):
        return None
    return family.for_problem(family.heuristic(problem, arch, _gpu.max_smem()), problem)


def layouts(family, config):
    """config and, for each other value of a layout parameter of the space (qsplit, persistent), the
    first variant with that value (warps adjusted if needed) that is valid on this GPU."""
    out = [config]
    smem = _gpu.max_smem()
    for key in ("qsplit", "persistent"):
        if key not in family.space:
            continue
        for value in family.space[key]:
            if value == getattr(config, key):
                continue
            candidates = [config.replace(**{key: value})] + [
                config.replace(**{key: value, "warps": w}) for w in family.space.get("warps", ())]
            out += [c for c in candidates if not c.problems(smem)][:1]
    return out


def main():
    only = set(sys.argv[sys.argv.index("--families") + 1:]) if "--families" in sys.argv else None
    picked = lambda fam: only is None or fam.name in only  # noqa: E731
    runs = 0
    for b, sq, sk, h, hkv, d, causal in SHAPES:
        for name, dtype in DTYPES.items():
            for fwd in filter(picked, registry.families("fwd")):
                cfg = heuristic(fwd, Problem("fwd", name, b, sq, sk, h, hkv, d, causal))
                if cfg is None:
                    continue
                q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
                k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
                for config in layouts(fwd, cfg):
                    cuflash.flash_attn_func(q, k, v, causal=causal, config=config)
                    runs += 1
            if name == "bf16":   # FP8 forward families (Family.dtypes "e4m3"), once per shape
                for fwd in filter(picked, registry.families("fwd", "e4m3")):
                    cfg = heuristic(fwd, Problem("fwd", "e4m3", b, sq, sk, h, hkv, d, causal))
                    if cfg is None:
                        continue
                    f8 = torch.float8_e4m3fn
                    q = torch.randn(b, sq, h, d, device="cuda").to(f8)
                    k, v = (torch.randn(b, sk, hkv, d, device="cuda").to(f8) for _ in range(2))
                    qd = torch.rand(b, hkv, device="cuda") + 0.5
                    for config in layouts(fwd, cfg):
                        cuflash.flash_attn_func(q, k, v, causal=causal, config=config, q_descale=qd,
                                                k_descale=qd, v_descale=qd)
                        runs += 1
            for bwd in filter(picked, registry.families("bwd")):
                for det in (False, True):
                    base = heuristic(bwd, Problem("bwd", name, b, sq, sk, h, hkv, d, causal, det))
                    if base is None:
                        continue
                    for bwd_config in layouts(bwd, base) if not det else [base]:
                        q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
                        k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
                                for _ in range(2))
                        out = cuflash.flash_attn_func(q, k, v, causal=causal, deterministic=det,
                                                      bwd_config=bwd_config)
                        out.backward(torch.randn_like(out))
                        runs += 1
    if only is not None:
        torch.cuda.synchronize()
        print(f"sanitize shapes done: {runs} runs ({', '.join(sorted(only))})")
        return 0
    # the default selection too (tuned table for this GPU, if any), GQA, deterministic
    q = torch.randn(1, 150, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 150, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True).sum().backward()
    torch.cuda.synchronize()
    print(f"sanitize shapes done: {runs + 1} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
