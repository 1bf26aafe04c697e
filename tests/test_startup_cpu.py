"""Start-up costs without a GPU (issue 12): the parsed copies of the tuned tables
(cuflash.select.parse_table)."""
from __future__ import annotations

import json

import pytest

from cuflash import select

TABLE = """format: 2
gpu: {name: Fake GPU, cc: '9.0'}
entries:
- key: {op: fwd, family: fa2_fwd, dtype: bf16, head_dim: 128, causal: true, features: [], seqlen: 4096}
  config: {Br: 128, Bc: 64, warps: 4, stages: 2}
  stamp: {version: 1, code_hash: abc}
  median_ms: 0.95
  tflops: 290.1
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tables"


def _table(tmp_path, text=TABLE):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return path


def test_parsed_copy_written_then_read(tmp_path, cache, monkeypatch):
    path = _table(tmp_path)
    first = select.read_file(path)
    assert not first.error and len(first.entries) == 1
    (copy,) = cache.glob("*.json")
    assert json.loads(copy.read_text()) == select._yaml_load(TABLE)
    assert not list(cache.glob("*.tmp"))

    def no_yaml(text):
        raise AssertionError("parsed the YAML again")

    monkeypatch.setattr(select, "_yaml_load", no_yaml)
    again = select.read_file(path)
    assert again.entries == first.entries and again.gpu_name == "Fake GPU" and again.cc == "9.0"


def test_edited_table_parsed_anew(tmp_path, cache):
    path = _table(tmp_path)
    select.read_file(path)
    path.write_text(TABLE.replace("median_ms: 0.95", "median_ms: 0.5"))
    assert select.read_file(path).entries[0].median_ms == 0.5
    assert len(list(cache.glob("*.json"))) == 2


def test_unreadable_copy_falls_back_to_yaml(tmp_path, cache):
    path = _table(tmp_path)
    select.read_file(path)
    (copy,) = cache.glob("*.json")
    copy.write_text("{not json")
    assert select.read_file(path).entries[0].tflops == 290.1
    assert json.loads(copy.read_text())["format"] == 2   # written again


def test_no_copy_where_json_differs_or_disabled(tmp_path, cache, monkeypatch):
    dated = TABLE.replace("  tflops: 290.1\n", "  tflops: 290.1\n  env: {date: 2026-11-27}\n")
    assert select.read_file(_table(tmp_path, dated)).entries[0].env["date"].year == 2026
    assert not cache.exists() or not list(cache.glob("*.json"))
    monkeypatch.setenv("CUFLASH_CACHE_DIR", "")
    assert select.parsed_dir() is None
    assert len(select.read_file(_table(tmp_path)).entries) == 1
    assert not cache.exists() or not list(cache.glob("*.json"))


def test_unwritable_cache_dir_still_reads(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(blocker))   # tables/ cannot be made under a file
    assert len(select.read_file(_table(tmp_path)).entries) == 1


def test_bad_yaml_is_an_error_not_an_exception(tmp_path, cache):
    out = select.read_file(_table(tmp_path, "format: [2\n"))
    assert out.error.startswith("cannot be read as YAML")
    assert select.read_file(tmp_path / "missing.yaml").error.startswith("cannot be read as YAML")


def test_shipped_table_round_trips(tmp_path, cache):
    """The shipped tables' data survive JSON exactly (so their copies are kept)."""
    for path in select.shipped_dir().glob("*.yaml"):
        text = path.read_text()
        assert select.parse_table(text) == select._yaml_load(text)
    assert list(cache.glob("*.json"))


# ---------------------------------------------------------------------------------------
# python -m cuflash warmup --features

@pytest.fixture
def h100(monkeypatch):
    from cuflash import _gpu

    monkeypatch.setattr(_gpu, "arch", lambda device=0: (9, 0))
    monkeypatch.setattr(_gpu, "name", lambda device=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(_gpu, "max_smem", lambda device=0: 232448)
    select._chosen.clear()
    yield
    select._chosen.clear()


def test_warmup_features_configs(h100):
    from cuflash import warmup
    from cuflash.problem import SEQLEN_BUCKETS

    plain = warmup.configs_to_warm(["fwd", "bwd"], ["bf16"], [128], [True])
    both = warmup.configs_to_warm(["fwd", "bwd"], ["bf16"], [128], [True], features=warmup.FEATURES)
    assert set(plain) < set(both) and len(set(both)) == len(both)
    extra = [c for c in both if c not in plain]
    for flag in warmup.FEATURES:   # each feature's kernels, forward and backward
        ops = {c.family for c in extra if getattr(c, flag, False)}
        assert ops == {"sm90_fwd", "sm90_bwd"}, (flag, ops)
    # what a first call's plan compiles: the choice, then its bounds
    s = SEQLEN_BUCKETS[-1]
    (p,) = warmup.feature_problems("fwd", "bf16", 128, True, "window", s)
    assert p.window == (warmup.WINDOW, 0) and p.features == ("window",)
    family, cfg, _ = select.choose_on_device(p, 0)
    assert family.for_bounds(cfg, p) in extra
    assert warmup.feature_problems("fwd", "bf16", 128, True, "window", 1024) == []   # the plain call
    assert warmup.feature_problems("bwd", "bf16", 128, False, "window", 4096)[0].window == (1024, 1024)
    assert [q.softcap for q in warmup.feature_problems("fwd", "bf16", 128, True, "softcap", s)] == [30.0, 50.0]
    assert warmup.feature_problems("fwd", "bf16", 128, True, "varlen", s)[0].features == ("varlen",)
    with pytest.raises(ValueError, match="features: unknown feature 'rope'"):
        warmup.feature_problems("fwd", "bf16", 128, True, "rope", s)


def test_warmup_features_flag_checked_first(capsys):
    from cuflash import warmup

    with pytest.raises(SystemExit) as e:
        warmup.main(["--features", "window,rope"])
    assert e.value.code == 2 and "--features: unknown feature 'rope'" in capsys.readouterr().err
