"""sm90_fwd's fixed-max softcap kernels (the softcap heuristic: fold_cap 3, d128) on
edge shapes, for compute-sanitizer (memcheck, racecheck, synccheck); not a test, a few seconds
without the sanitizer:

    compute-sanitizer --tool synccheck python tests/softcap_fixed_sanitize.py
    CUFLASH_SOFTCAP_FIELDS=s_ahead=1,BN=96,stages=3 compute-sanitizer ... (those fields forced on the
    heuristic's config, as tests/test_softcap_fixed_max_gpu.py forced_fields)
    compute-sanitizer ... python tests/softcap_fixed_sanitize.py --bwd   # the backward too (sm90_bwd's heuristic)
    ... --quick   # bf16 at cap 30 only
    CUFLASH_SOFTCAP_BWD_FIELDS=cap_fold=1 ... --bwd   # the backward forced: sm90_bwd's heuristic config for
                                                      # the softcap call with those fields
    CUFLASH_SOFTCAP_BWD_FIELDS=cap_fold=1 python tests/softcap_fixed_sanitize.py --bwd --precompile
                                                      # only compile those backward kernels (no sanitizer)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from softcap_fixed_timing import parse_variants  # noqa: E402

FORCED = parse_variants("forced:" + os.environ.get("CUFLASH_SOFTCAP_FIELDS", ""))["forced"]
BWD = "--bwd" in sys.argv
BWD_FORCED = parse_variants("forced:" + os.environ.get("CUFLASH_SOFTCAP_BWD_FIELDS", ""))["forced"]

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv): one key, ragged blocks, GQA, more tiles than a block
SHAPES = [(1, 1, 1, 2, 2), (1, 17, 113, 4, 1), (2, 203, 113, 4, 2), (1, 1, 300, 2, 2), (1, 300, 17, 2, 1)]
# (dtype, cap): bf16 at caps 30 and 5, fp16 at 4 (fixed max), fp16 at 30 and bf16 at 50 (Gemma 2's; the row max)
CAPS = [(torch.bfloat16, 30.0), (torch.bfloat16, 5.0), (torch.float16, 4.0), (torch.float16, 30.0),
        (torch.bfloat16, 50.0)]

PRECOMPILE = "--precompile" in sys.argv
if "--quick" in sys.argv:   # (racecheck's pace: bf16 at cap 30 only)
    CAPS = CAPS[:1]
todo = []
for dtype, cap in CAPS:
    for causal in (False, True):
        for b, sq, sk, h, hkv in SHAPES:
            q = torch.randn(b, sq, h, 128, device="cuda", dtype=dtype, requires_grad=BWD)
            k, v = (torch.randn(b, sk, hkv, 128, device="cuda", dtype=dtype, requires_grad=BWD) for _ in range(2))
            cfg = None
            if FORCED:   # the heuristic's config with the forced fields (its fold_cap >= 3 kernels only)
                fam = registry.get("sm90_fwd")
                p = cuflash.Problem("fwd", "bf16" if dtype == torch.bfloat16 else "fp16", b, sq, sk, h, hkv, 128,
                                    causal, features=("softcap",), softcap=cap)
                cfg = fam.for_problem(fam.heuristic(p, (9, 0), 227 * 1024), p).replace(**FORCED)
                assert not cfg.problems(), cfg.problems()
            bwd_cfg = None
            if BWD_FORCED:
                fam = registry.get("sm90_bwd")
                p = cuflash.Problem("bwd", "bf16" if dtype == torch.bfloat16 else "fp16", b, sq, sk, h, hkv, 128,
                                    causal, features=("softcap",), softcap=cap)
                bwd_cfg = fam.for_problem(fam.heuristic(p, (9, 0), 227 * 1024), p).replace(**BWD_FORCED)
                if bwd_cfg.problems():   # (cap_fold 2 on fp16: refused)
                    continue
                if PRECOMPILE:
                    todo.append(fam.for_problem(bwd_cfg, p))
                    continue
            out = cuflash.flash_attn_func(q, k, v, causal=causal, softcap=cap, config=cfg, bwd_config=bwd_cfg)
            assert not out.isnan().any(), (dtype, cap, causal, sq, sk)
            if BWD:
                dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
                assert not any(g.isnan().any() for g in (dq, dk, dv)), (dtype, cap, causal, sq, sk, "grads")
if PRECOMPILE:
    from cuflash import compile as cc

    print("precompiled", len(set(todo)), "failed", [(c.name, e) for c, _, e in cc.precompile(todo) if e], flush=True)
torch.cuda.synchronize()
print("softcap_fixed_sanitize: done", flush=True)
