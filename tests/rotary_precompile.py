"""Fill CuPy's kernel cache, in parallel worker processes, with every rotary module (not a test):
x in bf16 / fp16 / fp32, cos / sin in x's dtype or fp32, both pair orders, as cuflash.rotary's
plans name them (one module per (types, order): the one-element and the 16-byte-group kernels).

    CUPY_CACHE_DIR=/tmp/cupy_cache python tests/rotary_precompile.py [--processes 12]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import helper_precompile  # noqa: E402 - tests/ (this script's folder) is on sys.path


def modules() -> list:
    from cuflash.rotary import _KERNEL_TYPES

    out = []
    for x in _KERNEL_TYPES.values():
        for trig in dict.fromkeys((x, "float")):
            for order in ("false", "true"):
                types = f"{x}, {trig}, {order}"
                out.append((f"cuflash::rotary<{types}, false>", f"cuflash::rotary<{types}, true>"))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=12)
    args = ap.parse_args()
    sys.exit(helper_precompile.run("rotary", modules(), args.processes, "rotary", loader="get_helper_kernels"))


if __name__ == "__main__":
    main()
