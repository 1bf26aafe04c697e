"""Compare the plain (no-feature) kernels of the tuned table's configs between two source
trees, without a GPU: nvcc -cubin for sm_90a, ptxas -v resources and cuobjdump -sass with
constant-bank offsets masked. Used to decide which stale entries may be re-stamped.

    # in each tree (PYTHONPATH selects whose cuflash renders the source):
    PYTHONPATH=/tmp/old_tree python restamp_check.py compile TABLE OUT_old.json
    PYTHONPATH=$PWD          python restamp_check.py compile TABLE OUT_new.json
    python restamp_check.py compare OUT_old.json OUT_new.json > compare.json
    PYTHONPATH=$PWD python restamp_check.py decide OUT_old.json OUT_new.json TABLE NEW_TABLE ROWS.json

(cuobjdump and nvdisasm must be on PATH; the criterion applied by `decide` is criterion()'s
relaxed one, on the main kernel: see results/NVIDIA_H100_80GB_HBM3/tuning/restamp.md.)

Each kernel of a config (every role the family launches) is compiled in its own nvcc call;
results are keyed by (family, dtype, head_dim, causal, config point), so old and new line up
although the template argument lists differ (HEAD appends feature flags, all false here).
"""
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_RES = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_CMEM = re.compile(r"c\[0x([0-9a-f]+)\]\[0x[0-9a-f]+\]")
_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?);")


def mask(insn: str) -> str:
    return _CMEM.sub(lambda m: f"c[0x{m.group(1)}][X]", insn)


def sass_by_function(cubin: Path) -> dict:
    out = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    funcs, cur = {}, None
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _INSN.search(line)
        if m and cur is not None:
            cur.append(mask(m.group(1).strip()))
    return funcs


def opcode(insn: str) -> str:
    toks = insn.split()
    if toks and toks[0].startswith("@"):  # predicate guard
        toks = toks[1:]
    return toks[0] if toks else ""


def compile_config(job):
    fam_name, key, point = job
    from cuflash import registry
    from cuflash.compile import kernel_param_decl, render_source
    from cuflash.problem import Problem

    family = registry.get(fam_name)
    dtype, head_dim, causal = key
    p = Problem(family.op, dtype, 1, 1024, 1024, 1, 1, head_dim, causal, False)
    cfg = family.for_problem(family.make(point, p), p)
    result = {}
    for role, expr in family.kernel_names(cfg).items():
        try:
            decl = kernel_param_decl(family, role)
        except TypeError:  # older trees: one declaration for every role
            decl = kernel_param_decl(family)
        src = render_source(family.name) + '\n#line 1 "instantiations"\n' + \
            f"template __global__ void {expr}({decl});\n"
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "k.cu").write_text(src)
            proc = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v",
                                   "-o", f"{tmp}/k.cubin", f"{tmp}/k.cu"], capture_output=True, text=True)
            if proc.returncode:
                result[role] = {"error": proc.stderr[-2000:]}
                continue
            log = proc.stderr + proc.stdout
            regs = smem = barriers = None
            frame = (0, 0, 0)
            for line in log.splitlines():
                if m := _FRAME.search(line):
                    frame = tuple(int(x) for x in m.groups())
                if m := _RES.search(line):
                    regs, barriers, smem = (int(x) if x else 0 for x in m.groups())
            funcs = sass_by_function(Path(tmp) / "k.cubin")
        assert len(funcs) == 1, list(funcs)
        sass = next(iter(funcs.values()))
        result[role] = {"expr": expr, "registers": regs, "barriers": barriers, "smem": smem,
                        "stack": frame[0], "spill_stores": frame[1], "spill_loads": frame[2],
                        "n_insn": len(sass), "opcodes": dict(collections.Counter(map(opcode, sass))),
                        "sass": sass, "warnings": [l for l in log.splitlines() if "warning" in l]}
    return fam_name, key, point, result


def jobs_of(table):
    from cuflash import select

    tf = select.read_file(table)
    order = {"sm90_fwd": 0, "fa2_bwd": 1, "fa2_fwd": 2}
    seen = {}
    for e in tf.entries:
        if e.features:
            continue
        k = (e.family, (e.dtype, e.head_dim, e.causal), tuple(sorted(e.config.items())))
        seen.setdefault(k, (e.family, (e.dtype, e.head_dim, e.causal), dict(e.config)))
    fams = os.environ.get("FAMILIES", "sm90_fwd,fa2_bwd,fa2_fwd").split(",")
    jobs = [j for j in seen.values() if j[0] in fams]
    return sorted(jobs, key=lambda j: (order.get(j[0], 9), -j[1][1]))


def job_id(fam, key, point):
    return json.dumps([fam, list(key), sorted(point.items())])


def cmd_compile(table, out):
    done = json.loads(Path(out).read_text()) if Path(out).exists() else {}
    jobs = [j for j in jobs_of(table) if job_id(*j) not in done]
    print(f"{len(jobs)} configs to compile", file=sys.stderr)
    with ThreadPoolExecutor(int(os.environ.get("JOBS", "2"))) as pool:
        for fam, key, point, res in pool.map(compile_config, jobs):
            done[job_id(fam, key, point)] = res
            Path(out).write_text(json.dumps(done))
            print(fam, key, point, {r: (v.get("registers"), v.get("spill_stores")) for r, v in res.items()},
                  file=sys.stderr, flush=True)


def cmd_compare(old, new):
    old, new = json.loads(Path(old).read_text()), json.loads(Path(new).read_text())
    rows = []
    for k in old:
        if k not in new:
            continue
        fam, key, point = json.loads(k)
        o, n = old[k], new[k]
        roles = {}
        for role in o:
            a, b = o[role], n.get(role, {"error": "missing"})
            if "error" in a or "error" in b:
                roles[role] = {"error": True}
                continue
            res = ("registers", "barriers", "smem", "stack", "spill_stores", "spill_loads")
            diff_lines = sum(1 for x, y in zip(a["sass"], b["sass"]) if x != y) + abs(len(a["sass"]) - len(b["sass"]))
            roles[role] = {"old": {f: a[f] for f in res + ("n_insn",)}, "new": {f: b[f] for f in res + ("n_insn",)},
                           "res_equal": all(a[f] == b[f] for f in res),
                           "hist_equal": a["opcodes"] == b["opcodes"],
                           "sass_equal": a["sass"] == b["sass"], "sass_diff_lines": diff_lines}
        ok = all(r.get("res_equal") and r.get("hist_equal") for r in roles.values())
        rows.append({"family": fam, "key": key, "point": dict(point), "roles": roles, "restamp": ok})
    json.dump(rows, sys.stdout, indent=1)


# Opcodes of scalar set-up work: integer / predicate arithmetic, moves, constant-bank loads
# (the params struct grew, so its field offsets and loads move), NOP padding.
_SCALAR = re.compile(r"^(U?(IMAD|IADD3|LEA|LOP3|SHF|ISETP|SEL|MOV|PLOP3|PRMT|SHL|SHR)|VIADD|VIMNMX|"
                     r"VIADDMNMX|CS2R|S2R|S2UR|R2UR|U?LDC|NOP|HFMA2\.MMA)(\.|$)")


def criterion(role_old, role_new):
    """(strict, relaxed, scalar_diff): strict = equal ptxas resources and opcode histograms;
    relaxed = equal resources and every non-scalar opcode count equal (MMA, loads/stores,
    barriers, branches, FP math, spills), the histograms differing only in _SCALAR opcodes
    (HFMA2.MMA appears only as the zero-move idiom `HFMA2.MMA Rx, -RZ, RZ, 0, 0`)."""
    res = ("registers", "barriers", "smem", "stack", "spill_stores", "spill_loads")
    res_eq = all(role_old[f] == role_new[f] for f in res)
    a, b = collections.Counter(role_old["opcodes"]), collections.Counter(role_new["opcodes"])
    differing = {op for op in set(a) | set(b) if a[op] != b[op]}
    scalar_diff = sum(abs(a[op] - b[op]) for op in differing)
    hot_eq = all(_SCALAR.match(op) for op in differing)
    return res_eq and not differing, res_eq and hot_eq, scalar_diff


def cmd_decide(old, new, table, out_table, out_rows):
    """Re-stamp the entries whose main kernel passes the relaxed criterion; drop the rest."""
    from cuflash import registry, select
    from tuning.table import _write

    old, new = json.loads(Path(old).read_text()), json.loads(Path(new).read_text())
    verdict, rows = {}, []
    for k in old:
        fam, key, point = json.loads(k)
        roles = {}
        for role in old[k]:
            strict, relaxed, nd = criterion(old[k][role], new[k][role])
            roles[role] = {"strict": strict, "relaxed": relaxed, "scalar_diff": nd,
                           "sass_equal": old[k][role]["sass"] == new[k][role]["sass"],
                           "old": {f: old[k][role][f] for f in ("registers", "spill_stores", "spill_loads", "stack", "n_insn")},
                           "new": {f: new[k][role][f] for f in ("registers", "spill_stores", "spill_loads", "stack", "n_insn")}}
        # Only the main kernel depends on the tuned point; the other roles (fa2_bwd's
        # preprocess / convert_dq / reduce_dkv) are instantiated per dtype, the same for every
        # candidate, so they cannot change which config wins: reported, not decided on.
        ok = roles["main"]["relaxed"]
        verdict[k] = ok
        rows.append({"family": fam, "key": key, "point": dict(point), "roles": roles, "restamp": ok,
                     "strict": roles["main"]["strict"]})
    tf = select.read_file(table)
    kept = []
    counts = collections.Counter()
    for e in tf.entries:
        k = job_id(e.family, (e.dtype, e.head_dim, e.causal), e.config)
        if not e.features and verdict.get(k):
            stamp = select.current_stamp(registry.get(e.family))
            e.env = dict(e.env, restamped=f"stamp {e.stamp['code_hash']} -> {stamp['code_hash']} "
                                          "without re-measuring: SASS compared (restamp.md)")
            e.stamp = stamp
            kept.append(e)
            counts[(e.family, "restamped")] += 1
        else:
            counts[(e.family, "dropped")] += 1
    header = Path(table).read_text().splitlines(keepends=True)[0]
    _write(Path(out_table), tf.gpu_name, tf.cc, kept, header=header)
    Path(out_rows).write_text(json.dumps(rows, indent=1))
    print(dict(counts))


if __name__ == "__main__":
    {"compile": cmd_compile, "compare": cmd_compare, "decide": cmd_decide}[sys.argv[1]](*sys.argv[2:])
