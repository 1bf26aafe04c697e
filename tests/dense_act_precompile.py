"""Fill CuPy's kernel cache, in parallel worker processes, with the fused MLP's activation modules
(kernels_cu/dense_act.cu; not a test) that tests/test_fused_dense_gpu.py, dense_act_sanitize.py and
fused_mlp_timing.py use: bf16 and fp16, every activation, 16-byte and one-element accesses.

    CUPY_CACHE_DIR=/tmp/cupy_cache python tests/dense_act_precompile.py [--processes 12]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import helper_precompile  # noqa: E402 - tests/ (this script's folder) is on sys.path


def modules() -> list:
    import torch

    from cuflash.dense_act import ACTIVATIONS, kernel_names

    return [kernel_names(dt, act, v) for dt in (torch.bfloat16, torch.float16) for act in ACTIVATIONS
            for v in (True, False)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=12)
    args = ap.parse_args()
    sys.exit(helper_precompile.run("dense_act", modules(), args.processes, "dense_act"))


if __name__ == "__main__":
    main()
