"""Edge shapes for compute-sanitizer (memcheck, racecheck): run under it, not under pytest.

    compute-sanitizer --tool memcheck python tests/gpu_sanitize.py [--families fa2_fwd sm90_fwd ...]
    compute-sanitizer --tool racecheck python tests/gpu_sanitize.py --features

--families: only these kernel families (default: every registered one; the default-selection
run at the end happens only without the option).

Every registered kernel family runs, forced with config= / bwd_config=: each forward
family's heuristic, and each backward family's heuristic (preprocess, main kernel, dQ
epilogue, GQA reduction, through torch autograd) in every key-group layout its space offers
(fa2_bwd: qsplit 1 and 2; sm90_fwd: persistent off and on) and in deterministic mode. Each
decode family (op decode: flash_attn_with_kvcache) runs DECODE_SHAPES with num_splits 1, 3, 0,
as selected by default, with decode_splitkv's bandwidth options (l2_prefetch, warp_loads), with
its fused combine and page_gather, with 4-warp contiguous tiles and page 256 on the Hopper loop,
with lean and warp_loads, with ring_fill 2 + dynamic + lean, and, on
sm_90, on its Hopper loop (decode_splitkv_tma) both ways the heuristic can pick it (TMA_DEFAULT:
the heuristic's tiles; TMA_PAGED_DEFAULT: 4 warps, 3 stages for small pages), whatever those
switches say today.
"""
import contextlib
import itertools
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


DECODE_SHAPES = [  # (batch, seqlen_q, cache_seqlens, nheads, nheads_kv, hdim, page, seqlen_new, rotary_dim, leftpad)
    (1, 1, [0], 4, 4, 64, None, 0, 0, False), (2, 1, [1, 17], 8, 2, 128, None, 1, 64, False),
    (3, 4, [113, 0, 1023], 8, 1, 128, 16, 2, 128, False), (2, 16, [2049, 300], 16, 4, 96, 48, 0, 0, True),
    (1, 3, [5000], 32, 8, 256, 256, 3, 32, True),
]


SPLITS = (1, 3, 0)  # num_splits of each decode shape


@contextlib.contextmanager
def decode_loop(switches: dict):
    """decode_splitkv's module switches (TMA_DEFAULT, TMA_PAGED_DEFAULT) set to ``switches`` for
    the calls inside, with the call-shape plans dropped on entry and exit (they hold a config)."""
    from cuflash import decode as decode_mod
    from cuflash.families import decode_splitkv as mod

    old = {k: getattr(mod, k) for k in switches}
    decode_mod._gpu_plans.clear()
    try:
        for k, v in switches.items():
            setattr(mod, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(mod, k, v)
        decode_mod._gpu_plans.clear()


def decode_loops(family) -> list:
    """The module switches of each decode pass: the default selection; for decode_splitkv also
    its cp.async loop with both bandwidth options (l2_prefetch 256, warp_loads: no CTA barrier
    per block), with the fused combine and page_gather (paged: a block's page ids read first),
    and, on sm_90, its Hopper loop as TMA_DEFAULT picks it (every call it can run) and
    as TMA_PAGED_DEFAULT alone picks it (paged calls with small pages: 4 warps, 3 stages)."""
    loops = [{}]
    if family.name != "decode_splitkv":
        return loops
    loops.append(dict(TMA_DEFAULT=False, TMA_PAGED_DEFAULT=False, SMALL_PAGE_TMA_MAX_KEYS=0, LARGE_PAGE_TMA_MAX_KEYS=0,
                      L2_PREFETCH_DEFAULT=256, WARP_LOADS_DEFAULT=True))
    loops.append(dict(TMA_DEFAULT=False, TMA_PAGED_DEFAULT=False, SMALL_PAGE_TMA_MAX_KEYS=0, LARGE_PAGE_TMA_MAX_KEYS=0,
                      FUSED_COMBINE_DEFAULT=True, PAGE_GATHER_DEFAULT=True))
    # contiguous caches on 4-warp tiles (two CTAs per SM) with the co-resident split rule, and
    # page 256 on the Hopper loop (issue 13, session 16: candidates, off by default)
    loops.append(dict(TMA_DEFAULT=False, CONTIGUOUS_WARPS=4, CONTIGUOUS_STAGES=3,
                      SPLIT_RULE_RESIDENT_CONTIGUOUS=True, LARGE_PAGE_TMA_MAX_KEYS=1 << 20))
    loops.append(dict(TMA_DEFAULT=False, LEAN_DEFAULT=True, WARP_LOADS_DEFAULT=True))   # lean + warp_loads
    if _gpu.arch()[0] == 9:
        loops += [dict(TMA_DEFAULT=True, TMA_PAGED_DEFAULT=False),
                  dict(TMA_DEFAULT=False, TMA_PAGED_DEFAULT=True),
                  # the cp.async loop's bulk rows (cp.async.bulk on per-slot mbarriers) and the fused
                  # combine's early loads (session 17)
                  dict(TMA_DEFAULT=False, TMA_PAGED_DEFAULT=False, SMALL_PAGE_TMA_MAX_KEYS=0,
                       LARGE_PAGE_TMA_MAX_KEYS=0, BULK_DEFAULT=1, BULK_PAGED_DEFAULT=1,
                       EARLY_MERGE_DEFAULT=True)]
    # the cp.async loop's full-ring prologue with loads before S, and the splits' dynamic block
    # claims (session 20), with lean
    loops.append(dict(TMA_DEFAULT=False, TMA_PAGED_DEFAULT=False, SMALL_PAGE_TMA_MAX_KEYS=0, LARGE_PAGE_TMA_MAX_KEYS=0,
                      FUSED_COMBINE_DEFAULT=True, RING_FILL_DEFAULT=2, DYNAMIC_DEFAULT=1, DYNAMIC_MAX_GROUPS=1 << 30,
                      DYNAMIC_MIN_KEYS=0, LEAN_DEFAULT=True))
    # the first pass runs the heuristic's choice (decode_splitkv_regs at d 128 on sm_90); the others
    # pin options of the older loops, with the regs kernel off
    loops = loops[:1] + [dict(sw, REGS_DEFAULT=0) for sw in loops[1:]]
    only = os.environ.get("SANITIZE_DECODE_SWITCH")  # e.g. BULK_DEFAULT: only the passes that set it
    picked = os.environ.get("SANITIZE_DECODE_PASSES")  # e.g. 0,6: those passes of the list, by index
    if picked:
        loops = [loops[int(i)] for i in picked.split(",")]
    return [x for x in loops if only in x] if only else loops


def sanitize_decode(family):
    """flash_attn_with_kvcache on edge shapes (empty rows, paged with odd page sizes, append +
    rotary, leftpad), num_splits 1, 3 and 0 (3 with the LSE returned, the others without: a null
    lse), for the decode family (the API selects it), once per pass of ``decode_loops``
    (decode_splitkv on sm_90: its Hopper loop too)."""
    runs = 0
    for switches in decode_loops(family):
        with decode_loop(switches):
            runs += _sanitize_decode_pass(family, paged_only=switches.get("TMA_PAGED_DEFAULT", False)
                                          and not switches.get("TMA_DEFAULT", False))
    return runs


def _sanitize_decode_pass(family, paged_only: bool = False):
    runs = 0
    for b, sq, lens, h, hkv, d, page, new, rot, leftpad in DECODE_SHAPES:
        if paged_only and not page:
            continue
        for name, dtype in DTYPES.items():
            p = Problem("decode", name, b, sq, max(lens) + new, h, hkv, d)
            if heuristic(family, p) is None:
                continue
            for splits in SPLITS:
                cap = max(lens) + new
                if page:
                    blocks = -(-cap // page)
                    kc = torch.randn(b * blocks, page, hkv, d, device="cuda", dtype=dtype)
                    table = torch.randperm(b * blocks, device="cuda").view(b, blocks).to(torch.int32)
                else:
                    kc, table = torch.randn(b, cap, hkv, d, device="cuda", dtype=dtype), None
                vc = torch.randn_like(kc)
                kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                          block_table=table, num_splits=splits, causal=sq > 1)
                if new:
                    kw["k"] = torch.randn(b, new, hkv, d, device="cuda", dtype=dtype)
                    kw["v"] = torch.randn_like(kw["k"])
                if rot:
                    kw["rotary_cos"] = torch.randn(cap if not page else blocks * page, rot // 2,
                                                   device="cuda", dtype=dtype)
                    kw["rotary_sin"] = torch.randn_like(kw["rotary_cos"])
                if leftpad:
                    kw["cache_leftpad"] = torch.tensor([n // 3 for n in lens], dtype=torch.int32,
                                                       device="cuda")
                q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
                # the LSE stored (one split count) and skipped (a null lse: the others)
                cuflash.flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=splits == 3, **kw)
                runs += 1
    return runs


FEATURE_SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, hdim)
    (1, 17, 113, 4, 1, 64), (2, 203, 130, 4, 2, 128), (1, 300, 300, 2, 2, 59),
]
FEATURES = [  # flash_attn_func keywords: window (with and without causal), softcap, ALiBi, dropout
    dict(causal=True, window_size=(40, 0)), dict(window_size=(33, 7)), dict(softcap=20.0),
    dict(causal=True, alibi_slopes="heads"), dict(alibi_slopes="batch", window_size=(50, 50)),
    dict(dropout_p=0.17), dict(causal=True, dropout_p=0.17),
]


def feature_problem(name, b, sq, sk, h, hkv, d, spec):
    """The forward Problem of one FEATURES call as the API builds it: its features (sorted) and
    the head dim padded to a multiple of 8. The heuristics read the features (sm90_fwd narrows
    BN with window + ALiBi, fa2_fwd takes Bc 32 with dropout at d <= 64: the wider tiles spill),
    and supports() refuses a family that lacks one (sm90_fwd: dropout)."""
    feats = sorted(f for f, on in (("dropout", spec.get("dropout_p")), ("softcap", spec.get("softcap")),
                                   ("window", "window_size" in spec), ("alibi", spec.get("alibi_slopes")))
                   if on)
    return Problem("fwd", name, b, sq, sk, h, hkv, -(-d // 8) * 8, spec.get("causal", False),
                   features=tuple(feats), dropout_p=spec.get("dropout_p", 0.0),
                   window=spec.get("window_size", (-1, -1)), softcap=spec.get("softcap", 0.0),
                   alibi_batched=spec.get("alibi_slopes") == "batch")


def sanitize_features():
    """Window, softcap, ALiBi (each forward family forced with its heuristic config for the
    call's features, backward by the default) and dropout (fa2 families), forward + backward
    through torch autograd, then variable-length batches (lengths 0, 1, 17, 113) plain and
    causal, and their forward over a paged K/V cache (fa2_fwd_paged)."""
    runs = 0
    for b, sq, sk, h, hkv, d in FEATURE_SHAPES:
        for name, dtype in DTYPES.items():
            for spec in FEATURES:
                problem = feature_problem(name, b, sq, sk, h, hkv, d, spec)
                kw = dict(spec)
                slopes = kw.pop("alibi_slopes", None)
                if slopes is not None:
                    shape = (h,) if slopes == "heads" else (b, h)
                    kw["alibi_slopes"] = torch.rand(shape, device="cuda") * 0.5
                for fwd in registry.families("fwd"):
                    cfg = heuristic(fwd, problem)  # None where the family lacks a feature
                    if cfg is None:
                        continue
                    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
                    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
                            for _ in range(2))
                    out = cuflash.flash_attn_func(q, k, v, config=cfg, **kw)
                    out.backward(torch.randn_like(out))
                    runs += 1
    for name, dtype in DTYPES.items():
        for causal in (False, True):
            lens_q, lens_k = [0, 1, 17, 113], [5, 1, 113, 40]
            cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32, device="cuda")
            cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32, device="cuda")
            q = torch.randn(sum(lens_q), 4, 64, device="cuda", dtype=dtype, requires_grad=True)
            k, v = (torch.randn(sum(lens_k), 2, 64, device="cuda", dtype=dtype, requires_grad=True)
                    for _ in range(2))
            out = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
            out.backward(torch.randn_like(out))
            runs += 1
            # paged K/V (fa2_fwd_paged, forward only): pages 16 and 7 (tiles straddle pages),
            # shuffled, unused table columns -1; a window and ALiBi on the second
            for page, kw in ((16, {}), (7, dict(window_size=(20, 3), alibi_slopes=torch.rand(4, device="cuda")))):
                need = [-(-n // page) for n in lens_k]
                pages = sum(need) + 2
                kc, vc = (torch.randn(pages, page, 2, 64, device="cuda", dtype=dtype) for _ in range(2))
                table = torch.full((len(lens_k), max(need) + 1), -1, dtype=torch.int32)
                perm, at = torch.randperm(pages), 0
                for i, n in enumerate(need):
                    table[i, :n] = perm[at:at + n]
                    at += n
                with torch.no_grad():
                    cuflash.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k),
                                                   causal=causal, block_table=table.cuda(), **kw)
                runs += 1
    return runs


def _quick() -> None:
    """--quick (for racecheck, which tracks every shared-memory access and runs ~100x slower):
    bf16 only: a ragged MQA shape (d 40), a causal GQA d128 one with s_q > s_k, d 160 and the
    FP8 one; the decode shapes with 3 splits and the heuristic's."""
    global SHAPES, DTYPES, DECODE_SHAPES, FEATURE_SHAPES, SPLITS
    SHAPES = [SHAPES[i] for i in (1, 2, 7, 9)]
    DTYPES = {"bf16": DTYPES["bf16"]}
    DECODE_SHAPES = DECODE_SHAPES[1:4]
    FEATURE_SHAPES = FEATURE_SHAPES[:2]
    SPLITS = (3, 0)


def main():
    if "--quick" in sys.argv:
        sys.argv.remove("--quick")
        _quick()
    if "--features" in sys.argv:  # the API features' kernels (see sanitize_features)
        runs = sanitize_features()
        torch.cuda.synchronize()
        print(f"sanitize features done: {runs} runs")
        return 0
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
    for fam in filter(picked, registry.families("decode")):
        runs += sanitize_decode(fam)
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
