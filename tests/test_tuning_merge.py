"""tuning/merge.py: a fresh table's sm90 entries merged into the shipped one, keeping the rest. CPU only."""
import shutil
from pathlib import Path

import pytest

from cuflash import registry, select
from cuflash.select import Entry
from cuflash.tuning import merge
from cuflash.tuning.table import _write, save_entries

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "tuning" / "configs" / "NVIDIA_H100_80GB_HBM3_sm90.yaml"
GPU, CC = "NVIDIA H100 80GB HBM3", (9, 0)


def entry(family, seqlen, ms=1.0, stamp=None, **cfg):
    fam = registry.get(family)
    return Entry(op=fam.op, family=family, dtype="bf16", head_dim=128, causal=False, seqlen=seqlen,
                 config=cfg or {"BN": 176}, stamp=stamp or select.current_stamp(fam), median_ms=ms)


@pytest.fixture
def tables(tmp_path):
    target = tmp_path / "ship" / SHIPPED.name
    target.parent.mkdir()
    shipped = select.read_file(SHIPPED)
    # the shipped table without the families the tests merge (it ships sm90_fwd entries)
    _write(target, shipped.gpu_name, shipped.cc,
           [e for e in shipped.entries if e.family not in ("sm90_fwd", "sm90_bwd")])
    new_dir = tmp_path / "new"
    return target, new_dir


def test_merge_keeps_other_families_and_replaces_same_keys(tables):
    target, new_dir = tables
    before = select.read_file(target).entries
    assert before and not any(e.family in ("sm90_fwd", "sm90_bwd") for e in before)
    save_entries([entry("sm90_fwd", 2048), entry("sm90_fwd", 16384), entry("sm90_bwd", 2048),
                  entry("fa2_fwd", 2048, ms=9.0)], GPU, CC, new_dir)
    new = next(new_dir.glob("*.yaml"))
    counts = merge.merge(new, target, ["sm90_fwd", "sm90_bwd"])
    assert counts == dict(added=3, replaced=0, dropped=0, kept=len(before), total=len(before) + 3)
    after = select.read_file(target)
    assert not after.error and not after.bad_entries
    old = {e.key: e for e in before}
    got = {e.key: e for e in after.entries}
    assert all(got[k] == e for k, e in old.items())          # fa2_* / fp8 untouched (fa2_fwd's 9 ms not taken)
    assert {(e.family, e.seqlen) for e in after.entries if e.family.startswith("sm90_") and
            e.family != "sm90_fwd_fp8"} == {("sm90_fwd", 2048), ("sm90_fwd", 16384), ("sm90_bwd", 2048)}
    # again with a new time for one key: replaced; --replace drops the family's keys the new table lacks
    shutil.rmtree(new_dir)
    save_entries([entry("sm90_fwd", 2048, ms=0.5)], GPU, CC, new_dir)
    assert merge.main([str(new_dir), "--into", str(target), "--families", "sm90_fwd", "--replace"]) == 0
    after = {e.key: e for e in select.read_file(target).entries}
    fwd = [e for e in after.values() if e.family == "sm90_fwd"]
    assert len(fwd) == 1 and fwd[0].median_ms == 0.5
    assert sum(e.family == "sm90_bwd" for e in after.values()) == 1


def test_merge_refuses_stale_entries_and_other_gpus(tables, capsys):
    target, new_dir = tables
    save_entries([entry("sm90_fwd", 2048, stamp={"version": 0, "code_hash": "old"})], GPU, CC, new_dir)
    assert merge.main([str(new_dir), "--into", str(target)]) == 2
    assert "stale for this checkout's code" in capsys.readouterr().err
    assert merge.main([str(new_dir), "--into", str(target), "--allow-stale"]) == 0
    other = new_dir.parent / "other"
    save_entries([entry("sm90_fwd", 2048)], "Fake GPU", CC, other)
    with pytest.raises(ValueError, match="the new table is for Fake GPU"):
        merge.merge(next(other.glob("*.yaml")), target)
