"""SASS opcode counts of sm90_fwd's softcap kernels (the brief's method, features_overhead_session16.md):
each config compiled by nvcc for sm_90a (cuflash.compile.nvcc_compile's source), disassembled by
cuobjdump, and the instructions counted by opcode (the whole kernel; the softmax's share is what
differs between variants of one config). Optionally from a kernels_cu copy with
tests/softcap_fixed_timing.py's KVARIANTS edits.

    PATH=<dir of cuobjdump>:$PATH PYTHONPATH=. python results/NVIDIA_H100_80GB_HBM3/scripts/softcap_sass.py \
        [--kvariants e16_4,...] [--dtype bf16] [--variants name:field=value,...] [--ops MUFU,FFMA,...]
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def sass_counts(configs, kernel_dir=""):
    from cuflash import compile as cc

    if kernel_dir:
        cc._override = kernel_dir
    try:
        src = cc.render_source("sm90_fwd")
    finally:
        cc._override = ""
    fam_decl = cc.kernel_param_decl(__import__("cuflash.registry", fromlist=["get"]).get("sm90_fwd"))
    out = {}
    for c in configs:
        lines = [src, '#line 1 "instantiations"',
                 f"template __global__ void {c.kernel_name()}({fam_decl});"]
        with tempfile.TemporaryDirectory() as tmp:
            f = Path(tmp) / "k.cu"
            f.write_text("\n".join(lines) + "\n")
            cub = Path(tmp) / "k.cubin"
            p = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v", "-o", str(cub), str(f)],
                               capture_output=True, text=True)
            if p.returncode:
                raise RuntimeError(p.stderr[-3000:])
            spill = re.findall(r"(\d+) bytes spill stores", p.stderr)
            regs = re.findall(r"Used (\d+) registers", p.stderr)
            sass = subprocess.run(["cuobjdump", "-sass", str(cub)], capture_output=True, text=True, check=True).stdout
        ops = collections.Counter()
        for line in sass.splitlines():
            m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?", line)
            if m:
                ops[m.group(2)] += 1
                if m.group(2) == "MUFU":
                    ops["MUFU" + (m.group(3) or "")] += 1
        out[c.kernel_name()] = dict(ops=ops, total=sum(v for k, v in ops.items() if not k.startswith("MUFU.")),
                                    spill=spill, regs=regs)
    return out


def main():
    import softcap_fixed_timing as sft

    ap = argparse.ArgumentParser()
    ap.add_argument("--kvariants", default="")
    ap.add_argument("--variants", default="")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--ops", default="MUFU.TANH,MUFU.EX2,FFMA,FMUL,FADD,FMNMX,IMAD,SHF,LOP3,F2FP,FSEL,HGMMA")
    args = ap.parse_args()
    variants = sft.parse_variants(args.variants)
    sft.DTYPE = args.dtype
    ops = args.ops.split(",")
    print(f"{'row':28s} {'mask':6s} {'total':>6s} " + " ".join(f"{o:>9s}" for o in ops) + "  regs spill")
    for causal in (True, False):
        _, heur, extra = sft.configs(causal, variants)
        rows = [("cap30", heur, "")] + [(n, c, "") for n, c in extra.items()]
        for kv in filter(None, args.kvariants.split(",")):
            rows.append((f"cap30_{kv}", heur, sft.variant_dir(kv, tempfile.mkdtemp())))
        for name, cfg, kdir in rows:
            r = list(sass_counts([cfg], kdir).values())[0]
            print(f"{name:28s} {'causal' if causal else 'full':6s} {r['total']:6d} "
                  + " ".join(f"{r['ops'].get(o, 0):9d}" for o in ops) + f"  {r['regs']} {r['spill']}", flush=True)


if __name__ == "__main__":
    main()
