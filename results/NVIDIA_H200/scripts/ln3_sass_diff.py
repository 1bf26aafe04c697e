"""Session 29 (ln3): whether layer_norm.cu's kernels compile to the same SASS (machine code bytes) as another revision's
(default main's), per kernel instantiation, with nvcc -cubin for one arch (no GPU needed).

    PYTHONPATH=$PWD python results/NVIDIA_H200/scripts/ln3_sass_diff.py [--base main] [--arch sm_90a]
"""
import argparse
import struct
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from cuflash import compile as compile_mod
from cuflash import layer_norm as ln


def sass(kernel_dir: Path, names, arch, work: Path) -> dict:
    """{mangled kernel name: its SASS text} of the instantiations `names` of kernel_dir's layer_norm.cu."""
    src = compile_mod._render("layer_norm", kernel_dir)
    lines = [src] + [f"template __global__ void {n}(const cuflash::LayerNormParams);" for n in names]
    cu = work / "l.cu"
    cu.write_text("\n".join(lines) + "\n")
    subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-o", str(work / "l.cubin"), str(cu)],
                   check=True, capture_output=True, text=True)
    return text_sections((work / "l.cubin").read_bytes())


def text_sections(elf: bytes) -> dict:
    """{kernel: its machine code} from a cubin's .text.<mangled name> sections (ELF64; no cuobjdump
    on this host): the same bytes, the same SASS."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_off = heads[shstrndx][4]

    def name(off):
        return elf[names_off + off:elf.index(b"\0", names_off + off)].decode()

    return {name(h[0])[6:]: elf[h[4]:h[4] + h[5]] for h in heads if name(h[0]).startswith(".text.")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="main")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--threads", default="64,128,256,384")
    a = ap.parse_args()
    bf, f32 = torch.bfloat16, torch.float32
    names = []
    for t in (int(v) for v in a.threads.split(",")):
        for combo in ((bf, bf, bf), (bf, f32, bf)):
            names += [ln.kernel_names(*combo, t, True)[i] for i in (0, 1, 4)]   # fwd, bwd_dx, bwd
    names = list(dict.fromkeys(names))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base_dir = tmp / "base"
        shutil.copytree(compile_mod.kernel_dir(), base_dir)
        (base_dir / "layer_norm.cu").write_text(subprocess.run(
            ["git", "show", f"{a.base}:kernels_cu/layer_norm.cu"], check=True, capture_output=True, text=True).stdout)
        (tmp / "a").mkdir(), (tmp / "b").mkdir()
        base = sass(base_dir, names, a.arch, tmp / "a")
        head = sass(Path(compile_mod.kernel_dir()), names, a.arch, tmp / "b")
    same = 0
    for k in sorted(base):
        b, h = base[k], head.get(k)
        verdict = "same" if b == h else f"DIFFERENT ({len(b) // 16} vs {len(h or b'') // 16} instructions)"
        same += b == h
        print(f"{verdict:40s} {k}")
    print(f"{same} of {len(base)} kernels compile to the same SASS as {a.base} ({a.arch})")
    sys.exit(0)


if __name__ == "__main__":
    main()
