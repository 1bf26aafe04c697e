"""Merge a freshly tuned table into a shipped one, family by family:

    python -m cuflash.tuning.merge /tmp/tuned/NVIDIA_H100_80GB_HBM3_sm90.yaml \\
        --into tuning/configs/NVIDIA_H100_80GB_HBM3_sm90.yaml --families sm90_fwd,sm90_bwd

The new table's entries of ``--families`` (default: every family it has) replace the entries
with the same key (op, family, dtype, head dim, causal, features, seqlen) in the target; every
other entry of the target (e.g. fa2_fwd, fa2_bwd, sm90_fwd_fp8) is kept as it is. With
``--replace`` the target's entries of those families that the new table lacks are dropped too
(a re-tune of a whole family). Both tables must be of the same GPU and compute capability; an
entry of the new table that is stale for the code of this checkout (another family version or
kernel code hash, ``cuflash.select.stale_reasons``) is refused unless ``--allow-stale``: a
table tuned on other code would be ignored by the lookup anyway. The target is written
atomically (tuning.table's writer); the counts are printed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cuflash.select import current_stamp, read_file, stale_reasons

from .table import _write


def merge(new_path, into_path, families=None, replace: bool = False, allow_stale: bool = False) -> dict:
    """Merge ``new_path``'s entries into ``into_path`` (module doc). Returns the counts
    {"added", "replaced", "dropped", "kept", "total"}; raises ValueError with the reason when the
    tables do not go together."""
    from cuflash import registry

    new, old = read_file(Path(new_path)), read_file(Path(into_path))
    for tf, what in ((new, "new table"), (old, "target")):
        if tf.error:
            raise ValueError(f"{what} {tf.path}: {tf.error}")
        if tf.bad_entries:
            raise ValueError(f"{what} {tf.path}: {len(tf.bad_entries)} malformed entries")
    if (new.gpu_name, new.cc) != (old.gpu_name, old.cc):
        raise ValueError(f"the new table is for {new.gpu_name} sm_{new.cc}, the target for "
                         f"{old.gpu_name} sm_{old.cc}")
    fams = set(families) if families else {e.family for e in new.entries}
    unknown = fams - {f.name for f in registry.families()}
    if unknown:
        raise ValueError(f"unknown families {sorted(unknown)}")
    incoming = [e for e in new.entries if e.family in fams]
    if not allow_stale:
        stale = [(e, why) for e in incoming for why in [stale_reasons(e, current_stamp(registry.get(e.family)))]
                 if why]
        if stale:
            e, why = stale[0]
            raise ValueError(f"{len(stale)} entries of the new table are stale for this checkout's code, "
                             f"e.g. {e.family} {e.dtype} d{e.head_dim} s{e.seqlen}: {'; '.join(why)} "
                             "(--allow-stale merges them anyway)")
    merged = {e.key: e for e in old.entries}
    counts = dict(added=0, replaced=0, dropped=0)
    if replace:
        keys = {e.key for e in incoming}
        for k, e in list(merged.items()):
            if e.family in fams and k not in keys:
                del merged[k]
                counts["dropped"] += 1
    for e in incoming:
        counts["replaced" if e.key in merged else "added"] += 1
        merged[e.key] = e
    counts["kept"] = len(merged) - counts["added"] - counts["replaced"]
    counts["total"] = len(merged)
    _write(Path(into_path), old.gpu_name, old.cc, merged.values())
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuflash.tuning.merge", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("new", help="the freshly tuned table (a YAML file, or the --table-dir it was written to)")
    ap.add_argument("--into", required=True, help="the table to merge into (e.g. tuning/configs/<gpu>.yaml)")
    ap.add_argument("--families", default="", help="comma-separated families to take (default: all of the new table's)")
    ap.add_argument("--replace", action="store_true",
                    help="also drop the target's entries of those families that the new table lacks")
    ap.add_argument("--allow-stale", action="store_true",
                    help="merge entries whose stamp does not match this checkout's code")
    a = ap.parse_args(argv)
    new = Path(a.new)
    if new.is_dir():
        candidates = sorted(new.glob(Path(a.into).name)) or sorted(new.glob("*.yaml"))
        if len(candidates) != 1:
            print(f"merge: {new} holds {len(candidates)} tables; name the file", file=sys.stderr)
            return 2
        new = candidates[0]
    families = [f.strip() for f in a.families.split(",") if f.strip()] or None
    try:
        counts = merge(new, a.into, families, a.replace, a.allow_stale)
    except ValueError as exc:
        print(f"merge: {exc}", file=sys.stderr)
        return 2
    print(f"merged {new} into {a.into}: {counts['added']} added, {counts['replaced']} replaced, "
          f"{counts['dropped']} dropped, {counts['kept']} kept; {counts['total']} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
