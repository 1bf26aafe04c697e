"""Markdown tables for the README from bench_fwd.csv / bench_fwdbwd.csv / decode.json / overhead.json."""
import csv, collections, json, sys
R = sys.argv[1] if len(sys.argv) > 1 else 'results/NVIDIA_H100_80GB_HBM3'
SEQ = [2048, 4096, 8192, 16384]
def table(rows, fam, key, cmp_keys, hdims):
    t = collections.defaultdict(dict)
    for r in rows:
        if r[key] in ('', None): continue
        t[(int(r['hdim']), r['causal'] == 'True', int(r['seqlen']))][r['impl']] = float(r[key])
    out = ["| d | causal | 2k | 4k | 8k | 16k |", "| --- | --- | --- | --- | --- | --- |"]
    for d in hdims:
        for c in (False, True):
            cells = []
            for s in SEQ:
                v = t.get((d, c, s), {})
                x = v.get(fam)
                if x is None: cells.append('—'); continue
                rat = ' / '.join(f"{x / v[k]:.2f}×" for k in cmp_keys if v.get(k))
                cells.append(f"{x:.0f} ({rat})")
            out.append(f"| {d} | {'yes' if c else 'no'} | " + ' | '.join(cells) + ' |')
    return '\n'.join(out)
rows = list(csv.DictReader(open(f'{R}/bench_fwd.csv')))
print('FWD sm90_fwd\n' + table(rows, 'cuflash:sm90_fwd', 'tflops', ['sdpa_flash', 'sdpa_cudnn'], [64, 128, 256]))
rows = list(csv.DictReader(open(f'{R}/bench_fwdbwd.csv')))
# the selected backward per head dim
sel = {64: 'cuflash:sm90_bwd', 128: 'cuflash:sm90_bwd', 256: 'cuflash:sm90_bwd'}
for key, name in (('fwdbwd_tflops', 'FWD+BWD'), ('bwd_tflops', 'BWD')):
    for d, fam in sel.items():
        print(f'{name} d{d} {fam}\n' + table(rows, fam, key, ['sdpa_flash', 'sdpa_cudnn'], [d]))
d = json.load(open(f'{R}/decode.json'))
recs = d['records'] if isinstance(d, dict) else d
t = collections.defaultdict(dict)
for r in recs:
    impl = r['impl']
    t[(r['batch'], r['ctx'])][impl] = r['kv_TBps']
print('| batch × context | cuflash | paged 16 | paged 256 | SDPA flash | SDPA cuDNN |\n| --- | --- | --- | --- | --- | --- |')
for (b, c), v in sorted(t.items()):
    f = lambda k: f"{v[k]:.2f}" if v.get(k) else '—'
    print(f"| {b} × {c // 1024}k | {f('cuflash')} | {f('cuflash_page16')} | {f('cuflash_page256')} | {f('sdpa_flash')} | {f('sdpa_cudnn')} |")
o = json.load(open(f'{R}/overhead.json'))
for r in o['records']:
    print(r['impl'], r['path'], {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items() if k in ('us_per_call', 'tflops', 'wall_ms', 'kernel_ms')})
