"""dec25's round summary (session 29): the two processes' decode_paged_timing.py json side by side,
per label µs, spread (slowest round / fastest) and × the contiguous call of the same process.

    python results/NVIDIA_H200/scripts/dec25_summary.py DIR/paged1.json DIR/paged2.json
"""
import json
import sys


def main(paths):
    runs = [{r["label"]: r for r in json.load(open(p))["records"]} for p in paths]
    labels = list(runs[0])
    head = f"{'label':10s} {'page':>4s} {'config':58s}" + "".join(f" | p{i + 1} us  spread  x_contig" for i in range(len(runs)))
    print(head)
    key = lambda lab: (runs[0][lab]["page"], runs[0][lab].get("us") or 1e9)
    for lab in sorted(labels, key=key):
        r0 = runs[0][lab]
        line = f"{lab:10s} {r0['page']:>4d} {r0['config'][:58]:58s}"
        for run in runs:
            r = run.get(lab, {})
            if r.get("us"):
                xc = f"{r['x_contig']:.3f}" if r.get("x_contig") else "  -  "
                line += f" | {r['us']:6.2f}  {r['spread']:.3f}  {xc:>8s}"
            else:
                line += f" | {str(r.get('error', 'none'))[:24]:24s}"
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
