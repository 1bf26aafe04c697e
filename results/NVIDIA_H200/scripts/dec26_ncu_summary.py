"""dec26 round 3: ncu's details (duration, DRAM, L2, warp states) and SASS stall samples of each config, side by side:
the total samples per stall reason, and the instructions with the most samples (address, SASS, samples, top reasons),
with the global loads marked.

    python results/NVIDIA_H200/scripts/dec26_ncu_summary.py DIR/ncu [labels ...]
"""
import csv
import sys
from pathlib import Path

DETAILS = ("Duration", "DRAM Throughput", "Memory Throughput", "L2 Hit Rate", "Warp Cycles Per Issued Instruction",
           "Registers Per Thread", "Achieved Occupancy", "Elapsed Cycles", "SM Frequency")


def rows(path):
    lines = [ln for ln in open(path) if ln.startswith('"')]
    return list(csv.reader(lines))


def details(path) -> dict:
    rs = rows(path)
    head = rs[0]
    i_name, i_val, i_unit = head.index("Metric Name"), head.index("Metric Value"), head.index("Metric Unit")
    out = {}
    for r in rs[1:]:
        if r[i_name] in DETAILS or r[i_name].startswith(("dram__", "lts__", "gpu__")):
            out[r[i_name]] = f"{r[i_val]} {r[i_unit]}".strip()
    return out


def sass(path):
    rs = rows(path)
    k = next(i for i, r in enumerate(rs) if r and r[0] == "Address")
    head, body = rs[k], rs[k + 1:]
    col = {h: i for i, h in enumerate(head)}
    reasons = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in body:
        try:
            n = int(float(r[col["Warp Stall Sampling (All Samples)"]] or 0))
        except ValueError:
            continue
        rs_ = {h: int(float(r[col[h]] or 0)) for h in reasons}
        out.append((r[col["Address"]], r[col["Source"]].strip(), n, rs_))
    return out


def main(d, labels):
    d = Path(d)
    labels = labels or sorted(p.name[:-len("_sass.csv")] for p in d.glob("*_sass.csv"))
    for lab in labels:
        print(f"== {lab}")
        for k, v in details(d / f"{lab}_details.csv").items():
            print(f"   {k}: {v}")
    tot = {}
    for lab in labels:
        ins = sass(d / f"{lab}_sass.csv")
        by = {}
        for _, _, _, rs_ in ins:
            for h, n in rs_.items():
                by[h] = by.get(h, 0) + n
        tot[lab] = (sum(n for _, _, n, _ in ins), by, ins)
    reasons = sorted({h for _, by, _ in tot.values() for h in by}, key=lambda h: -sum(t[1].get(h, 0) for t in tot.values()))
    print("\nstall samples (all), per reason:")
    print(f"{'reason':22s}" + "".join(f"{lab:>12s}" for lab in labels))
    print(f"{'TOTAL':22s}" + "".join(f"{tot[lab][0]:12d}" for lab in labels))
    for h in reasons[:12]:
        print(f"{h:22s}" + "".join(f"{tot[lab][1].get(h, 0):12d}" for lab in labels))
    for lab in labels:
        n_all, _, ins = tot[lab]
        print(f"\n== {lab}: top instructions by samples ({n_all} in all)")
        for addr, src, n, rs_ in sorted(ins, key=lambda x: -x[2])[:22]:
            top = ", ".join(f"{h[6:]} {v}" for h, v in sorted(rs_.items(), key=lambda x: -x[1])[:3] if v)
            print(f"   {addr:>6s} {n:6d}  {src[:64]:64s} {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
