"""decode_splitkv_regs' kPageShift (session 30, dec26, issue 13; the script first served round 1's kPageAhead, since
dropped). With an old kernels_cu/ given, the SASS of the default kernels (pdl_sass_check's DEFAULTS, the shipped
batch-1 configs, contiguous and paged at pages 16 / 256) compiled from it and from this checkout's must be identical;
the regs_page_shift kernels of the paged batch-1 configs (regs_order 0 / 1) compile for sm_90a without spills, with
their instruction counts and the global loads after pdl's wait in SASS order (i: a 32-bit load, W: a 128-bit one).

    PYTHONPATH=. python results/NVIDIA_H200/scripts/dec26_sass_check.py [/work/main/kernels_cu]
"""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "NVIDIA_H100_80GB_HBM3" / "scripts"))

from pdl_sass_check import DEFAULTS, FAM, sass  # noqa: E402
from spec_sass_check import shipped  # noqa: E402
from cuflash.compile import kernel_dir  # noqa: E402
from cuflash.problem import Problem  # noqa: E402


def paged_shipped() -> list:
    out = []
    for page in (16, 256):
        p = Problem("decode", "bf16", 1, 1, 8192, 32, 8, 128, False, False, ("paged_kv",))
        out.append(FAM.call_config(FAM.heuristic(p, (9, 0)), p, (9, 0), page, chosen=True,
                                   heuristic=True).replace(splits=0))
    return list(dict.fromkeys(out))


def ahead_configs() -> list:
    base = [c.replace(regs_page_table=0, regs_page_shift=0) for c in paged_shipped()]
    return list(dict.fromkeys([c.replace(regs_page_shift=1, regs_order=o) for c in base for o in (0, 1)] + base))


def load_seq(body: str, n: int = 48) -> str:
    lines = [ln for ln in body.splitlines() if re.search(r"\b[A-Z]", ln)]
    wait = next((i for i, ln in enumerate(lines) if "ACQBULK" in ln), 0)
    seq = []
    for i, ln in enumerate(lines[wait:], wait):
        if "LDG.E.128" in ln:
            seq.append((i, "W"))
        elif re.search(r"LDG\.E(\.\w+)* R", ln) or "SHFL" in ln:
            seq.append((i, "s" if "SHFL" in ln else "i"))
        if len(seq) >= n:
            break
    return " ".join(f"{k}{i}" for i, k in seq)


def main(old_root: str = "") -> int:
    new_root = kernel_dir()
    bad = []
    if old_root:
        # the shipped configs but the paged batch-1 ones that take regs_page_shift (new kernels), and those
        # configs without it (the kernels they ran before)
        defaults = list(dict.fromkeys(DEFAULTS + [c.replace(regs_page_shift=0) for c in shipped() + paged_shipped()]))
        exprs = {e: role for c in defaults for role, e in FAM.kernel_names(c).items()}
        old, _, _ = sass(Path(old_root), exprs)
        new, _, _ = sass(new_root, exprs)
        bad = [k for k in old if old[k] != new.get(k)]
        print(f"default kernels: {len(old)} functions, {len(bad)} differ" + "".join(f"\n  DIFFERS {k}" for k in bad))
    cfgs = ahead_configs() + paged_shipped()
    print("configs: " + ", ".join(c.name for c in cfgs))
    exprs = {FAM.kernel_names(c)["main"]: "main" for c in cfgs}
    got, spills, log = sass(new_root, exprs)
    print(f"kernels: {len(got)} functions, spills {spills}")
    for line in log.splitlines():
        if "registers" in line:
            print("  " + line.strip()[:160])
    for k, body in sorted(got.items(), key=str):
        n_ins = sum(1 for ln in body.splitlines() if re.search(r"\b[A-Z]", ln))
        n_div = sum(1 for ln in body.splitlines() if "I2F.U32.RP" in ln)
        print(f"  {k}: {n_ins} instructions, {n_div} I2F.U32.RP (divisions)\n"
              f"    loads after the wait (i: 32-bit, W: 128-bit, s: shfl): {load_seq(body)}")
    return 1 if bad or any(spills) else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
