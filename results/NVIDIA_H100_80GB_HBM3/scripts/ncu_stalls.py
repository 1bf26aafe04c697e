"""Stall reasons per kernel and per SASS instruction from `ncu -i rep --page source --csv --print-source sass`
output (several kernels, each headed by a "Kernel Name" row): per kernel the warp-stall samples by reason, and
the top instructions by samples with their main reason; a window of instructions around each.

    python results/NVIDIA_H100_80GB_HBM3/scripts/ncu_stalls.py ncu_sass.log [--top 25]
"""
import csv
import sys
from collections import Counter


def kernels(path):
    name, header, rows = None, None, []
    with open(path, newline="") as fh:
        for row in csv.reader(fh):
            if not row:
                continue
            if row[0] == "Kernel Name":
                if name:
                    yield name, header, rows
                name, header, rows = row[1], None, []
            elif row[0] == "Address":
                header = row
            elif header and len(row) == len(header):
                rows.append(dict(zip(header, row)))
    if name:
        yield name, header, rows


def main(path, top=25):
    for name, header, rows in kernels(path):
        stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        total = Counter()
        for r in rows:
            for c in stall_cols:
                total[c] += int(r[c] or 0)
        n = sum(total.values())
        print(f"\n=== {name[:150]}\n  samples {n}; instructions {len(rows)}; executed "
              f"{sum(int(r['Instructions Executed'] or 0) for r in rows)} warp instructions")
        print("  by reason: " + ", ".join(f"{k[6:]} {v} ({100 * v / max(n, 1):.1f}%)" for k, v in total.most_common(8)))
        idx = sorted(range(len(rows)), key=lambda i: -int(rows[i]["Warp Stall Sampling (All Samples)"] or 0))[:top]
        for i in idx:
            r = rows[i]
            s = int(r["Warp Stall Sampling (All Samples)"] or 0)
            why = Counter({c[6:]: int(r[c] or 0) for c in stall_cols}).most_common(2)
            print(f"  #{i:5d} {100 * s / max(n, 1):5.1f}%  {r['Source'].strip()[:60]:60s} {why}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 25)
