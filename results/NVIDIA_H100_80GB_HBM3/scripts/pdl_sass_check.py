"""decode_splitkv's pdl (session 26, dec17): the SASS of the default kernels (pdl 0) compiled from an old
kernels_cu/ and from this checkout's must be identical, and the pdl kernels' SASS shows where the wait
and the trigger sit. nvcc -cubin sm_90a, cuobjdump -sass (PATH, else /tmp/cuobj and /tmp/nvd wheels).

    PYTHONPATH=. python results/NVIDIA_H100_80GB_HBM3/scripts/pdl_sass_check.py /work/main/kernels_cu
"""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from cuflash.compile import _mangled_args, _render, kernel_dir, kernel_param_decl  # noqa: E402
from cuflash.families.decode_splitkv import DecodeConfig  # noqa: E402
from cuflash.registry import get  # noqa: E402

FAM = get("decode_splitkv")
BASE = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, fused_combine=True, light_fence=True)
DEFAULTS = [BASE.replace(regs=1), BASE.replace(regs=6, regs_prefetch=True, regs_order=1, regs_prefetch_blocks=3),
            BASE.replace(regs=6, regs_order=1, regs_page_table=1, regs_prefetch=True, regs_prefetch_blocks=3),
            BASE.replace(regs=2), BASE.replace(regs=1, regs_order=2, regs_prefetch=True)]


def tools():
    from test_sm90_softcap_cpu import _cuobjdump

    t = _cuobjdump()
    if t is None:
        raise SystemExit("cuobjdump / nvdisasm not found")
    return t


def sass(root: Path, exprs: dict) -> dict:
    """{(role, template args): SASS text} of the kernels `exprs` ({expr: role}) compiled from `root`."""
    cuobj, nvd = tools()
    lines = [_render(FAM.name, Path(root)), '#line 1 "inst"']
    lines += [f"template __global__ void {e}({kernel_param_decl(FAM, role, e)});" for e, role in exprs.items()]
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        src.write_text("\n".join(lines) + "\n")
        proc = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v", "-o", str(out),
                               str(src)], capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill", proc.stderr)]
        env = {**os.environ, "PATH": nvd + os.pathsep + os.environ["PATH"]}
        text = subprocess.run([cuobj, "-sass", str(out)], check=True, capture_output=True, text=True, env=env).stdout
    funcs = {}
    for fn in text.split("Function : ")[1:]:
        name = fn.split("\n")[0].strip()
        kind = "regs" if "regs" in name else "append" if "append" in name else "combine" if "combine" in name else "x"
        body = re.sub(r"/\*[0-9a-f]{4,}\*/", "", fn.split("\n", 1)[1])   # addresses; not the (mangled) name
        args = list(_mangled_args(name))
        while args and args[-1] in (0, False):   # a defaulted trailing parameter mangles as written
            args.pop()
        funcs[(kind, tuple(args))] = body
    return funcs, spills, proc.stderr


def main(old_root: str) -> int:
    new_root = kernel_dir()
    exprs = {e: role for c in DEFAULTS for role, e in FAM.kernel_names(c).items()}
    old, _, _ = sass(Path(old_root), exprs)
    new, spills, _ = sass(new_root, exprs)
    bad = [k for k in old if old[k] != new.get(k)]
    print(f"default kernels: {len(old)} functions, {len(bad)} differ" + "".join(f"\n  DIFFERS {k}" for k in bad))
    pdl = [c.replace(pdl=v) for c in DEFAULTS for v in (1, 2)]
    exprs = {e: role for c in pdl for role, e in FAM.kernel_names(c).items()}
    got, spills, log = sass(new_root, exprs)
    print(f"pdl kernels: {len(got)} functions, spills {spills}")
    for (kind, args), body in sorted(got.items(), key=str):
        ops = [ln for ln in body.splitlines() if re.search(r"ACQBULK|DEPBAR|PREEXIT|ACQ|griddep|CCTL", ln)]
        print(f"  {kind} {args}: {len(body.splitlines())} lines; " + " | ".join(o.strip()[:60] for o in ops[:6]))
    return 1 if bad or any(spills) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
