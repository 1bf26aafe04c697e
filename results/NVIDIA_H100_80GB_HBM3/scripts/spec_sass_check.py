"""decode_splitkv_regs' kSpec (session 28, dec20): the SASS of the default kernels (kSpec 0: pdl_sass_check's
DEFAULTS and the shipped batch-1 configs at 1 x 4k / 8k / 16k, contiguous and paged) compiled from an old
kernels_cu/ and from this checkout's must be identical; the kSpec kernels compile for sm_90a without spills, and
their SASS issues the early K/V loads (and Q's) before cache_seqlens' load (printed: the line of the first
LDG.E.128 and of the first 32-bit LDG after the wait). nvcc -cubin sm_90a, cuobjdump -sass.

    PYTHONPATH=. python results/NVIDIA_H100_80GB_HBM3/scripts/spec_sass_check.py /work/main/kernels_cu
"""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdl_sass_check import DEFAULTS, FAM, sass  # noqa: E402
from cuflash.compile import kernel_dir  # noqa: E402
from cuflash.problem import Problem  # noqa: E402


def shipped() -> list:
    out = []
    for ctx in (4096, 8192, 16384):
        for page in (0, 16):
            p = Problem("decode", "bf16", 1, 1, ctx, 32, 8, 128, False, False, ("paged_kv",) if page else ())
            out.append(FAM.call_config(FAM.heuristic(p, (9, 0)), p, (9, 0), page, chosen=True,
                                       heuristic=True).replace(splits=0))
    return list(dict.fromkeys(out))


def spec_configs() -> list:
    p = Problem("decode", "bf16", 1, 1, 8192, 32, 8, 128, False, False, ())
    base = FAM.call_config(FAM.heuristic(p, (9, 0)), p, (9, 0), 0, chosen=True, heuristic=True).replace(splits=0)
    assert base.pdl == 1 and base.early_merge and base.regs_order == 0, base.name   # the shipped 1 x 8k config
    return [base.replace(regs_order=2, regs_spec=1), base.replace(regs_order=2, regs_spec=2),
            base.replace(regs_order=2, regs_spec=1, pdl=0), base.replace(regs_order=2, regs_spec=2, head_dim=64)]


def order(body: str) -> str:
    lines = [ln for ln in body.splitlines() if re.search(r"\b[A-Z]", ln)]
    wait = next((i for i, ln in enumerate(lines) if "ACQBULK" in ln), 0)
    ldg128 = [i for i, ln in enumerate(lines) if "LDG.E.128" in ln]
    first128 = ldg128[0] if ldg128 else -1
    twentieth = ldg128[19] if len(ldg128) > 19 else -1   # kSpec at d 128: 16 early K/V loads and Q's 4
    first32 = next((i for i, ln in enumerate(lines) if re.search(r"LDG\.E R|LDG\.E\.STRONG|LD\.E R", ln)), -1)
    first_mma = next((i for i, ln in enumerate(lines) if "HMMA" in ln), -1)
    return (f"wait at {wait}, first LDG.E.128 at {first128}, 20th at {twentieth}, first 32-bit load at {first32}, "
            f"first HMMA at {first_mma}")


def main(old_root: str) -> int:
    new_root = kernel_dir()
    defaults = list(dict.fromkeys(DEFAULTS + shipped()))
    exprs = {e: role for c in defaults for role, e in FAM.kernel_names(c).items()}
    old, _, _ = sass(Path(old_root), exprs)
    new, _, _ = sass(new_root, exprs)
    bad = [k for k in old if old[k] != new.get(k)]
    print(f"default kernels: {len(old)} functions, {len(bad)} differ" + "".join(f"\n  DIFFERS {k}" for k in bad))
    for k in sorted(new, key=str):
        if k[0] == "regs":
            print(f"  {k}: {order(new[k])}")
    cfgs = spec_configs() + [c.replace(regs_spec=0) for c in spec_configs()[:1]]
    exprs = {FAM.kernel_names(c)["main"]: "main" for c in cfgs}
    got, spills, log = sass(new_root, exprs)
    print(f"kSpec kernels (and regs_order 2 without it): {len(got)} functions, spills {spills}")
    for line in log.splitlines():
        if "registers" in line:
            print("  " + line.strip()[:160])
    for k, body in sorted(got.items(), key=str):
        print(f"  {k}: {order(body)}")
    return 1 if bad or any(spills) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
