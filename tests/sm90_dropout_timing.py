"""Quick timing of dropout in sm90_fwd on an H100 (issue 12: each feature's overhead <= 10%):
the forward with dropout_p = 0.1 against the same call without, one line per kernel, at the
FlashAttention benchmark's shape (batch x seqlen = 16k, 2048 / head_dim heads, bf16):

    timeout 300 python tests/sm90_dropout_timing.py              # d128 causal, seqlen 8k
    python tests/sm90_dropout_timing.py --hdims 64 128 256 --causal both

Rows: plain (what selection runs without dropout), sm90_fwd dropout at DROPOUT_BN (what
selection runs with it), fa2_fwd's dropout (what ran before). The wider BNs that ptxas spills
a few bytes for were timed too (1.04-1.26x DROPOUT_BN's at d128, session 11) and are now
refused by Sm90FwdConfig.problems(), so the filter below leaves them out. The ratio is
ms / plain ms. Samples are interleaved (cuflash.timing.time_interleaved). Not a test.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

P = 0.1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdims", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="yes")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    sm90, fa2 = registry.get("sm90_fwd"), registry.get("fa2_fwd")
    causals = {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]
    print(f"{'case':<28} {'kernel':<58} {'ms':>8} {'TFLOPs':>7} {'x plain':>8}")
    for d in args.hdims:
        for causal in causals:
            s, h = args.seqlen, 2048 // d
            b = max(1, 16384 // s)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            plain = Problem("fwd", "bf16", b, s, s, h, h, d, causal)
            drop = plain.replace(features=("dropout",), dropout_p=P)
            heur = sm90.for_problem(sm90.heuristic(drop), drop)
            fns = {"plain": (lambda: cuflash.flash_attn_func(q, k, v, causal=causal))}
            names = {"plain": "(selection, no dropout)"}
            configs = [heur] + [heur.replace(BN=bn) for bn in (144, 160, 176, 192)
                                if bn > heur.BN and not heur.replace(BN=bn).problems(227 * 1024)]
            configs.append(fa2.for_problem(fa2.heuristic(drop), drop))
            for i, cfg in enumerate(configs):
                fns[f"c{i}"] = (lambda cfg=cfg: cuflash.flash_attn_func(q, k, v, P, causal=causal, config=cfg))
                names[f"c{i}"] = cfg.name
            for key, fn in fns.items():   # compile outside the timing, and fail loudly here
                out = fn()
                assert not out.isnan().any(), f"{names[key]}: NaN in the output"
            torch.cuda.synchronize()
            times = time_interleaved(fns, reps=args.reps, back_to_back=3)
            base = times["plain"].median_ms
            case = f"d{d} {'causal' if causal else 'full'} b{b} s{s} h{h}"
            for key, t in times.items():
                tflops = op_flops(plain) / t.median_ms / 1e9
                print(f"{case:<28} {names[key]:<58} {t.median_ms:8.3f} {tflops:7.1f} {t.median_ms / base:8.3f}")


if __name__ == "__main__":
    main()
