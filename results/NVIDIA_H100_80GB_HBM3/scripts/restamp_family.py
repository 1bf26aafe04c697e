"""Re-stamp one family's entries of a tuned table whose kernels did not change: every distinct
(dtype, head dim, causal, config) of the family's plain (no-feature) entries is compiled for
sm_90a in an old source tree (the one the entries are stamped for) and in this checkout, and
an entry gets this checkout's stamp only if its main kernel's SASS (constant-bank offsets
masked) and ptxas resources are identical (restamp.md's strict criterion). Entries whose
kernel changed, and feature entries, are left as they are (stale: the heuristic serves them
until re-tuned); other families' entries are not touched.

    git archive <old commit> | (mkdir -p /tmp/old_tree && tar -x -C /tmp/old_tree)
    PATH=<dir of cuobjdump>:<dir of nvdisasm>:$PATH PYTHONPATH=. \\
        python results/NVIDIA_H100_80GB_HBM3/scripts/restamp_family.py sm90_fwd /tmp/old_tree \\
        tuning/configs/NVIDIA_H100_80GB_HBM3_sm90.yaml

(nvcc, cuobjdump and nvdisasm on PATH; about 5 s of nvcc per config and tree.)
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECK = HERE / "restamp_check.py"


def compile_tree(tree: str, family: str, table: str) -> dict:
    out = Path(tempfile.mkdtemp()) / "out.json"
    env = dict(os.environ, PYTHONPATH=str(tree), FAMILIES=family, JOBS="1")
    subprocess.run([sys.executable, str(CHECK), "compile", str(Path(table).resolve()), str(out)],
                   cwd=tree, env=env, check=True)
    return json.loads(out.read_text())


def main(family: str, old_tree: str, table: str) -> None:
    sys.path.insert(0, str(HERE))
    from restamp_check import job_id

    from cuflash import registry, select
    from tuning.table import _write

    old = compile_tree(old_tree, family, table)
    new = compile_tree(os.getcwd(), family, table)
    res = ("registers", "barriers", "smem", "stack", "spill_stores", "spill_loads")
    same = {k: all(f in o["main"] and o["main"][f] == new[k]["main"].get(f) for f in res + ("sass",))
            for k, o in old.items() if k in new}
    stamp = select.current_stamp(registry.get(family))
    code = f"from cuflash import registry, select; print(select.current_stamp(registry.get({family!r}))['code_hash'])"
    old_hash = subprocess.run([sys.executable, "-c", code], cwd=old_tree, env=dict(os.environ, PYTHONPATH=str(old_tree)),
                              capture_output=True, text=True, check=True).stdout.strip()
    tf = select.read_file(table)
    counts = {"restamped": 0, "left stale": 0}
    for e in tf.entries:
        if e.family != family:
            continue
        k = job_id(e.family, (e.dtype, e.head_dim, e.causal), e.config)
        # only entries measured on the old tree's code, whose kernel compiles to the same SASS
        if not e.features and same.get(k) and e.stamp.get("code_hash") == old_hash and e.stamp != stamp:
            note = (f"stamp {e.stamp['code_hash']} -> {stamp['code_hash']} without re-measuring: "
                    "identical SASS (restamp_family.py)")
            earlier = e.env.get("restamped")
            e.env = dict(e.env, restamped=f"{earlier}; {note}" if earlier else note)
            e.stamp = stamp
            counts["restamped"] += 1
        elif e.stamp != stamp:
            counts["left stale"] += 1
    header = Path(table).read_text().splitlines(keepends=True)[0]
    _write(Path(table), tf.gpu_name, tf.cc, tf.entries, header=header)
    print(f"{family}: {sum(same.values())} of {len(same)} configs with identical SASS; entries {counts}; "
          f"old tree's code hash {old_hash}, stamp now {stamp}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
