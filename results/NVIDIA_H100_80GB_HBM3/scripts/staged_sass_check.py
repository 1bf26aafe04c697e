"""decode_splitkv_regs' kStaged (session 27, dec18): the SASS of the default kernels (kStaged 0) compiled from an
old kernels_cu/ and from this checkout's must be identical; the staged kernels compile for sm_90a without spills
(ptxas registers and shared memory per kernel printed), and so does decode_combine's kEarly (the regs kernel's
early_merge). nvcc -cubin sm_90a, cuobjdump -sass (pdl_sass_check's tools).

    PYTHONPATH=. python results/NVIDIA_H100_80GB_HBM3/scripts/staged_sass_check.py /work/main/kernels_cu
"""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdl_sass_check import BASE, DEFAULTS, FAM, sass  # noqa: E402
from cuflash.compile import kernel_dir  # noqa: E402

STAGED = [BASE.replace(regs=1, regs_staged=2), BASE.replace(regs=1, warps=4, regs_staged=2),
          BASE.replace(regs=1, warps=4, regs_staged=2, fused_combine=False, light_fence=False),
          BASE.replace(regs=1, warps=4, regs_staged=1), BASE.replace(regs=1, warps=4, regs_staged=3),
          BASE.replace(regs=6, regs_staged=2, regs_order=1, regs_prefetch=True, regs_prefetch_blocks=3),
          BASE.replace(regs=1, warps=4, regs_staged=2, head_dim=64)]


def main(old_root: str) -> int:
    new_root = kernel_dir()
    exprs = {e: role for c in DEFAULTS for role, e in FAM.kernel_names(c).items()}
    old, _, _ = sass(Path(old_root), exprs)
    new, _, _ = sass(new_root, exprs)
    bad = [k for k in old if old[k] != new.get(k)]
    print(f"default kernels: {len(old)} functions, {len(bad)} differ" + "".join(f"\n  DIFFERS {k}" for k in bad))
    em = [c.replace(fused_combine=False, light_fence=False, early_merge=True, pdl=pdl) for c in STAGED[:1] for pdl in (0, 1)]
    exprs = {e: role for c in STAGED for role, e in FAM.kernel_names(c).items() if role == "main"}
    exprs.update({FAM.kernel_names(c)["combine"]: "combine" for c in em})   # decode_combine's kEarly
    got, spills, log = sass(new_root, exprs)
    print(f"staged kernels: {len(got)} functions, spills {spills}")
    for line in log.splitlines():
        if "registers" in line or "Compiling entry" in line:
            print("  " + line.strip()[:200])
    for (kind, args), body in sorted(got.items(), key=str):
        n_ldgsts = len(re.findall(r"LDGSTS", body))
        n_ldg = len(re.findall(r"LDG\.E", body))
        print(f"  {kind} {args}: {len(body.splitlines())} lines, LDGSTS {n_ldgsts}, LDG {n_ldg}")
    return 1 if bad or any(spills) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
