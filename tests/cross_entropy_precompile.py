"""Fill CuPy's kernel cache, in parallel worker processes, with the cross-entropy modules (not a
test): one per logits dtype (bf16 / fp16 / fp32), as cuflash.cross_entropy's plans name them, and
bf16 modules of other (threads, unroll) choices for the timing script's --variants.

    CUPY_CACHE_DIR=/tmp/cupy_cache python tests/cross_entropy_precompile.py [--processes 3] [--variants 512x2]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import helper_precompile  # noqa: E402 - tests/ (this script's folder) is on sys.path


def modules(variants=()) -> list:
    """The default module of each dtype, then bf16 modules of (threads, unroll) variants."""
    import torch

    from cuflash.cross_entropy import _KERNEL_TYPES, kernel_names

    out = [kernel_names(dt) for dt in _KERNEL_TYPES]
    out += [kernel_names(torch.bfloat16, v, v) for v in variants]
    return list(dict.fromkeys(out))


def parse_variants(text: str) -> list:
    """'256x4,512x2' -> [(256, 4), (512, 2)]"""
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--variants", default="", help="bf16 (threads x unroll) variants too, e.g. 128x4,512x2")
    args = ap.parse_args()
    sys.exit(helper_precompile.run("cross_entropy", modules(parse_variants(args.variants)), args.processes, "cross-entropy", loader="get_helper_kernels"))


if __name__ == "__main__":
    main()
