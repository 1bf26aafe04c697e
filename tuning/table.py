"""Writing tuned tables. Reading, staleness and lookup are ``cuflash.select``'s (the library
reads tables without the tuner); this module only writes them, in ``cuflash.select``'s
format (``select.FORMAT``, ``select.Entry``, ``select.file_name``), and upgrades old files.

    save_entries([outcome.entry(env)], gpu_name, cc)      # merge into the user cache
    save_rules("decode_splitkv", [Rule(...)], gpu_name, cc)   # a family's device rules
    upgrade_v1("tuning/configs/NVIDIA_H100_80GB_HBM3_sm90.yaml")   # format 1 -> 2, in place

An entry's key is (op, family, dtype, head_dim, causal, features, seqlen); its ``stamp``
(``cuflash.select.current_stamp(family)``: the family's version and kernel code hash)
says which code it was measured on; an entry whose stamp differs from the running code is
ignored by the lookup (one ``TunedTableWarning`` per file).
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

from cuflash.select import FORMAT, Entry, Rule, cc_str, file_name, read_file, user_dir

log = logging.getLogger("cuflash.tuning")

HEADER = ("# cuflash tuned configs (format {format}); written by python -m cuflash tune. "
          "Read by cuflash.select\n")

# Format 1 (before the family registry) keyed entries by kernel: fwd or bwd.
V1_FAMILIES = {"fwd": ("fwd", "fa2_fwd"), "bwd": ("bwd", "fa2_bwd"),
               "flash_fwd": ("fwd", "fa2_fwd"), "flash_bwd": ("bwd", "fa2_bwd")}


def _order(e: Entry) -> tuple:
    return (e.op, e.family, e.dtype, e.head_dim, e.causal, e.features, e.seqlen)


def _write(path: Path, gpu_name: str, cc, entries, header: str = "", rules=None) -> Path:
    """Write a format-2 table atomically (mode 0644). ``rules`` (``cuflash.select.Rule``, the
    device rules): None keeps those of the file there (a re-tune or a restamp never drops them)."""
    import yaml

    if rules is None:
        old = read_file(path) if Path(path).is_file() else None
        rules = old.rules if old is not None and not old.error else []
    doc = {"format": FORMAT, "gpu": {"name": gpu_name, "cc": cc_str(cc)},
           "entries": [e.to_dict() for e in sorted(entries, key=_order)]}
    if rules:
        doc["rules"] = [r.to_dict() for r in rules]
    text = (header or HEADER.format(format=FORMAT)) + yaml.safe_dump(doc, sort_keys=False, width=100)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    from cuflash.select import clear_cache

    clear_cache()  # the next lookup re-reads the table (and may warn again)
    return path


def save_entries(entries: list, gpu_name: str, cc, directory=None) -> Path:
    """Merge ``entries`` (``cuflash.select.Entry``) into the GPU's table in ``directory``
    (default: the user cache, ``cuflash.select.user_dir()``); returns its path.

    Entries with the same key are replaced. The file is written atomically; an existing
    file that cannot be read (or is another GPU's, or of another format) is moved aside to
    ``*.corrupt`` rather than overwritten.
    """
    directory = Path(directory) if directory is not None else user_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / file_name(gpu_name, cc)
    merged: dict = {}
    if path.exists():
        old = read_file(path)
        if old.error or (old.gpu_name, old.cc) != (gpu_name, cc_str(cc)):
            aside = path.with_suffix(".yaml.corrupt")
            os.replace(path, aside)
            log.warning("moved unreadable or foreign tuned table %s to %s (%s)", path, aside,
                        old.error or f"it is for {old.gpu_name} sm_{old.cc}")
        else:
            merged = {e.key: e for e in old.entries}
    for e in entries:
        if not isinstance(e, Entry):
            raise TypeError(f"entries: expected cuflash.select.Entry, got {type(e).__name__}")
        merged[e.key] = e
    return _write(path, gpu_name, cc, merged.values())


def save_rules(family: str, rules: list, gpu_name: str, cc, directory=None) -> Path:
    """Replace ``family``'s device rules (``cuflash.select.Rule``, first match wins) in the GPU's
    table in ``directory`` (default: the user cache), keeping its entries and other families'
    rules; returns its path."""
    directory = Path(directory) if directory is not None else user_dir()
    path = directory / file_name(gpu_name, cc)
    old = read_file(path) if path.is_file() else None
    if old is not None and (old.error or (old.gpu_name, old.cc) != (gpu_name, cc_str(cc))):
        raise ValueError(f"{path}: not this GPU's readable table ({old.error or old.gpu_name}); not written")
    for r in rules:
        if not isinstance(r, Rule) or r.family != family:
            raise TypeError(f"rules: expected cuflash.select.Rule of {family}, got {r!r}")
    kept = [r for r in (old.rules if old else []) if r.family != family]
    return _write(path, gpu_name, cc, old.entries if old else [], rules=kept + list(rules))


def upgrade_v1_doc(doc: dict) -> dict:
    """A format-1 table (``key: {kernel: fwd|bwd, ...}``, stamp in ``env.source_hash``) as a
    format-2 document. Every entry gets ``stamp: {version: 1, code_hash:
    retired-<source_hash>}``: it was measured on kernels that no longer exist, so the lookup
    treats it as stale (kept for the record and its runners-up) until it is re-tuned."""
    if not isinstance(doc, dict) or doc.get("format", 1) != 1:
        raise ValueError(f"not a format-1 tuned table (format {doc.get('format') if isinstance(doc, dict) else '?'})")
    gpu = doc["gpu"]
    entries = []
    for i, rec in enumerate(doc.get("entries") or []):
        try:
            key = dict(rec["key"])
            op, family = V1_FAMILIES[key.pop("kernel")]
            env = dict(rec.get("env") or {})
            new = dict(rec, key={"op": op, "family": family, **key, "features": list(key.get("features") or [])},
                       stamp={"version": 1, "code_hash": f"retired-{env.get('source_hash', 'unknown')}"})
            entries.append(Entry.from_dict(new))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"entry {i}: {exc.__class__.__name__}: {exc}") from None
    return {"format": FORMAT, "gpu": {"name": str(gpu["name"]), "cc": cc_str(gpu["cc"])},
            "entries": entries}


def upgrade_v1(path, out=None) -> Path:
    """Rewrite the format-1 table at ``path`` in format 2 (to ``out``, default in place);
    returns the path written. A table already in format 2 is left alone."""
    import yaml

    path = Path(path)
    doc = yaml.safe_load(path.read_text())
    if isinstance(doc, dict) and doc.get("format") == FORMAT:
        return path
    new = upgrade_v1_doc(doc)
    header = (HEADER.format(format=FORMAT).rstrip("\n") + "\n# upgraded from format 1 by "
              "tuning.table.upgrade_v1: its entries carry retired code hashes (stale) until re-tuned\n")
    return _write(Path(out) if out is not None else path, new["gpu"]["name"], new["gpu"]["cc"],
                  new["entries"], header)


__all__ = ["save_entries", "save_rules", "upgrade_v1", "upgrade_v1_doc", "Entry", "FORMAT"]
