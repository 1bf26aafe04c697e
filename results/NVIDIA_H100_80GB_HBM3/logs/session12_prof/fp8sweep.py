"""FP8 forward: every valid point of sm90_fwd_fp8's space at (d, causal, seqlen), next to bf16
sm90_fwd (tuned) and SDPA cuDNN bf16, same inputs. CUDA events, warm-up, median of 20."""
import itertools, json, sys, torch
import cuflash
from cuflash.families.sm90_fwd_fp8 import FAMILY as F8
from cuflash.problem import Problem
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as Fn

def t(fn, reps=20):
    fn(); torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[reps // 2]

out = []
for d, causal, s in [(256, False, 16384), (256, True, 16384), (128, False, 16384), (64, False, 16384), (256, False, 4096)]:
    h, b = 2048 // d, 16384 // s
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    one = torch.ones(1, device="cuda")
    fl = 4 * b * h * s * s * d / (2 if causal else 1)
    p8 = Problem("fwd", "e4m3", b, s, s, h, h, d, causal)
    base = F8.heuristic(p8)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        ms = t(lambda: Fn.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    out.append(dict(impl="sdpa_cudnn_bf16", d=d, causal=causal, s=s, ms=ms, tflops=fl / ms / 1e9)); print(out[-1], flush=True)
    ms = t(lambda: cuflash.flash_attn_func(q, k, v, causal=causal))
    out.append(dict(impl="cuflash_bf16", d=d, causal=causal, s=s, ms=ms, tflops=fl / ms / 1e9)); print(out[-1], flush=True)
    keys = list(F8.space)
    for vals in itertools.product(*(F8.space[k] for k in keys)):
        cfg = base.replace(**dict(zip(keys, vals)))
        if cfg.problems(227 * 1024):
            continue
        try:
            ms = t(lambda: cuflash.flash_attn_func(q8, k8, v8, causal=causal, config=cfg, q_descale=one, k_descale=one, v_descale=one))
        except Exception as e:
            print("FAIL", cfg.name, str(e)[:200], flush=True); continue
        out.append(dict(impl="fp8", cfg=cfg.name, d=d, causal=causal, s=s, ms=ms, tflops=fl / ms / 1e9)); print(out[-1], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
