"""decode_splitkv_regs' kPageTable 2 (session 31, dec28, issue 13). With an old kernels_cu/ given, the SASS of the
default kernels (pdl_sass_check's DEFAULTS, the shipped batch-1 configs, contiguous and paged) compiled from it and from
this checkout's must be identical. Then the paged batch-1 config (the H200's: regs_page_table 0) and the H200 rule's
(regs_page_table 2) compile for sm_90a without spills, with, for each, the 32-bit global loads (LDG.E, page ids) after
the first K/V load (LDG.E.128) and the scoreboards the K/V loads set: regs_page_table 2 should read no id from
global memory once the K/V stream has started.

    PYTHONPATH=. python results/NVIDIA_H200/scripts/dec28_sass_check.py [/work/main/kernels_cu]
"""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "NVIDIA_H100_80GB_HBM3" / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dec26_sass_check import paged_shipped  # noqa: E402
from pdl_sass_check import DEFAULTS, FAM, sass  # noqa: E402
from spec_sass_check import shipped  # noqa: E402
from cuflash.compile import kernel_dir  # noqa: E402


def scoreboards(body: str):
    """[(instruction, write scoreboard or None)] from cuobjdump text (the control word: the second hex of each line pair)."""
    out, pending = [], None
    for ln in body.splitlines():
        hexes = re.findall(r"/\* (0x[0-9a-f]{16}) \*/", ln)
        txt = re.sub(r"/\*.*?\*/", "", ln).strip()
        if txt and hexes:
            pending = txt
        elif hexes and pending is not None:
            wb = (int(hexes[0], 16) >> 46) & 7
            out.append((pending, None if wb == 7 else wb))
            pending = None
    return out


def main(old_root: str = "") -> int:
    bad = []
    if old_root:
        defaults = list(dict.fromkeys(DEFAULTS + shipped() + paged_shipped()))
        exprs = {e: role for c in defaults for role, e in FAM.kernel_names(c).items()}
        old, _, _ = sass(Path(old_root), exprs)
        new, _, _ = sass(kernel_dir(), exprs)
        bad = [k for k in old if old[k] != new.get(k)]
        print(f"default kernels: {len(old)} functions, {len(bad)} differ" + "".join(f"\n  DIFFERS {k}" for k in bad))
    base = [c.replace(regs_page_table=0) for c in paged_shipped()]
    cfgs = list(dict.fromkeys(base + [c.replace(regs_page_table=2) for c in base]))
    print("configs: " + ", ".join(c.name for c in cfgs))
    got, spills, log = sass(kernel_dir(), {FAM.kernel_names(c)["main"]: "main" for c in cfgs})
    print(f"kernels: {len(got)} functions, spills {spills}")
    for line in log.splitlines():
        if "registers" in line:
            print("  " + line.strip()[:160])
    kKLoads = 128 // 32
    for k, body in sorted(got.items(), key=str):
        ins = scoreboards(body)
        wide = [i for i, (t, _) in enumerate(ins) if "LDG.E.128" in t]
        first = wide[kKLoads]   # past Q's kKLoads 128-bit loads: the first K/V load
        ids = [t for t, _ in ins[first:] if re.search(r"LDG\.E(\.\w+)* R", t) and "LDG.E.128" not in t]
        sbs = sorted({sb for t, sb in ins if "LDG.E.128" in t})
        print(f"  {k}: {len(ins)} instructions; after the first K/V load: {len(ids)} global 32-bit loads, "
              f"{sum('LDS' in t for t, _ in ins[first:])} LDS; K/V loads' scoreboards {sbs}")
    return 1 if bad or any(spills) else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
