"""Device rules (tuned tables' ``rules``; cuflash.select.heuristic_on_device, decode_splitkv's
heuristic_for_device) without a GPU: a rule in one GPU's table changes the decode heuristic's
choice (loop, warps, L2 prefetch, split rule) for the problems it matches on that GPU only; the
arch heuristic stays the fallback (other GPUs, other shapes, no table); a tuned entry wins over a
rule; malformed rules are ignored with a warning; writing entries or rules keeps the rules."""
import warnings

import pytest

from cuflash import select
from cuflash.families import decode_splitkv as mod
from cuflash.problem import Problem
from cuflash.registry import get

FAM = get("decode_splitkv")
H100, H200, CC = "NVIDIA H100 80GB HBM3", "NVIDIA H200", (9, 0)
SMEM = 232448


def _p(batch=1, ctx=8192, paged=False, d=128):
    return Problem("decode", "bf16", batch, 1, ctx, 32, 8, d, False, False, ("paged_kv",) if paged else ())


def _table(tmp_path, gpu, rules, entries=()):
    from tuning.table import _write

    path = tmp_path / select.file_name(gpu, CC)
    _write(path, gpu, CC, list(entries), rules=[select.Rule.from_dict(r) for r in rules])
    select.clear_cache()
    return path


def _choose(tmp_path, problem, gpu=H100):
    fam, cfg, source = select.choose(problem, CC, gpu, SMEM, dirs=[tmp_path], family="decode_splitkv")
    return cfg, source


RULES = [
    {"family": "decode_splitkv", "match": {"batch": [1, 1], "paged": False, "head_dim": [128]}, "set": {"regs": 0},
     "note": "batch 1, contiguous: the older loop"},
    {"family": "decode_splitkv", "match": {"batch": [8, None], "seqlen_k": [32768, None]},
     "set": {"regs_ahead": 2, "split_cost": 8}},
    {"family": "decode_splitkv", "match": {"batch": [8, None]}, "set": {"regs_warps": 4, "splits": 3}},
    {"family": "sm90_fwd", "match": {}, "set": {"anything": 1}},   # another family's: not read by decode
]


def test_rules_choose_per_device(tmp_path):
    _table(tmp_path, H100, RULES)
    heur = FAM.heuristic(_p(), CC, SMEM)
    assert heur.regs == mod.REGS_BATCH1_HINT[0][1]   # 1 x 8k: the batch-1 hint, where no rule sets regs
    cfg, source = _choose(tmp_path, _p())
    assert cfg.regs == 0 and not cfg.regs_ahead and source.startswith("heuristic (") and "device rule" in source
    assert cfg == FAM.heuristic(_p(), CC, SMEM, {"regs": 0})         # the older loop's own heuristic config
    cfg, _ = _choose(tmp_path, _p(batch=1, paged=True))               # paged: the first rule does not match
    assert cfg == FAM.heuristic(_p(batch=1, paged=True), CC, SMEM)
    cfg, _ = _choose(tmp_path, _p(batch=8, ctx=32768))
    assert cfg.regs == mod.REGS_DEFAULT and cfg.regs_ahead == 2 and cfg.split_cost == 8 and cfg.splits == 0
    cfg, _ = _choose(tmp_path, _p(batch=32, ctx=8192))                # 8k keys: the third rule
    assert cfg.warps == 4 and cfg.splits == 3 and cfg.regs == mod.REGS_DEFAULT and not cfg.regs_ahead
    cfg, _ = _choose(tmp_path, _p(batch=8, ctx=32768, paged=True))    # paged: no L2 prefetch
    assert cfg.regs_ahead == 0 and cfg.split_cost == 8
    # another GPU (no table of its own) and no GPU name: the arch heuristic
    for gpu in (H200, ""):
        cfg, source = _choose(tmp_path, _p(), gpu)
        assert cfg == FAM.for_problem(FAM.heuristic(_p(), CC, SMEM), _p()) and "device rule" not in source


def test_rules_of_two_gpus(tmp_path):
    _table(tmp_path, H100, RULES[:1])
    _table(tmp_path, H200, [{"family": "decode_splitkv", "match": {"batch": [1, 1]}, "set": {"regs": 1}}])
    assert _choose(tmp_path, _p(), H100)[0].regs == 0
    assert _choose(tmp_path, _p(), H200)[0].regs == 1
    assert select.device_rules(FAM, H200, CC, [tmp_path])[0][0].set == {"regs": 1}


def test_tuned_entry_wins(tmp_path):
    p = _p()
    tuned = FAM.heuristic(p, CC, SMEM).replace(warps=4)
    entry = select.Entry(op="decode", family="decode_splitkv", dtype="bf16", head_dim=128, causal=False,
                         seqlen=p.bucket, config=FAM.point(tuned), stamp=select.current_stamp(FAM))
    _table(tmp_path, H100, RULES, [entry])
    cfg, source = _choose(tmp_path, p)
    assert cfg.warps == 4 and cfg.regs == tuned.regs and source.startswith("tuned")


@pytest.mark.parametrize("bad", [
    {"family": "decode_splitkv", "match": {"batches": [1, 1]}, "set": {"regs": 0}},      # unknown match key
    {"family": "decode_splitkv", "match": {"batch": 1}, "set": {"regs": 0}},             # not a span
    {"family": "decode_splitkv", "match": {}, "set": {"warps": 4}},                       # unknown parameter
    {"family": "decode_splitkv", "match": {}, "set": {"regs": 9}},                        # out of range
    {"family": "decode_splitkv", "match": {}, "set": {"regs_ahead": True}},               # not an int
    {"family": "decode_splitkv", "match": {}, "set": {"splits": 200}},                    # past MAX_SPLITS
])
def test_bad_rule_ignored_with_warning(tmp_path, bad):
    _table(tmp_path, H100, [bad, RULES[0]])
    with pytest.warns(select.TunedTableWarning, match="rule"):
        cfg, source = _choose(tmp_path, _p())
    assert cfg.regs == 0 and "device rule" in source                  # the next rule still applies


def test_malformed_rule_records(tmp_path):
    path = tmp_path / select.file_name(H100, CC)
    path.write_text("format: 2\ngpu: {name: NVIDIA H100 80GB HBM3, cc: '9.0'}\nentries: []\n"
                    "rules:\n- {family: decode_splitkv}\n- {family: decode_splitkv, set: {regs: 0}, match: {batch: [1, 1]}}\n")
    select.clear_cache()
    tf = select.read_file(path)
    assert len(tf.rules) == 1 and len(tf.bad_rules) == 1 and not tf.error
    with pytest.warns(select.TunedTableWarning, match="malformed rules"):
        assert _choose(tmp_path, _p())[0].regs == 0


def test_writers_keep_rules(tmp_path):
    from tuning.table import save_entries, save_rules

    _table(tmp_path, H100, RULES)
    p = _p()
    entry = select.Entry(op="decode", family="decode_splitkv", dtype="bf16", head_dim=128, causal=False,
                         seqlen=65536, config=FAM.point(FAM.heuristic(p, CC, SMEM)), stamp=select.current_stamp(FAM))
    save_entries([entry], H100, CC, tmp_path)
    tf = select.read_file(tmp_path / select.file_name(H100, CC))
    assert [r.to_dict() for r in tf.rules] == RULES and len(tf.entries) == 1
    save_rules("decode_splitkv", [select.Rule("decode_splitkv", {"regs": 1}, {"batch": [2, 4]})], H100, CC, tmp_path)
    tf = select.read_file(tmp_path / select.file_name(H100, CC))
    assert [r.family for r in tf.rules] == ["sm90_fwd", "decode_splitkv"] and len(tf.entries) == 1
    assert tf.rules[1].set == {"regs": 1}


def test_shipped_tables_rules_valid():
    """Every shipped decode rule parses and gives a valid config on a few shapes."""
    from pathlib import Path

    for path in Path(select.shipped_dir()).glob("*.yaml"):
        tf = select.read_file(path)
        assert not tf.bad_rules, (path, tf.bad_rules)
        for rule in tf.rules:
            if rule.family != "decode_splitkv":
                continue
            for b, ctx, paged in ((1, 8192, False), (8, 32768, False), (32, 8192, True), (64, 131072, False)):
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    FAM.heuristic_for_device(_p(b, ctx, paged), CC, SMEM, rule)


def test_shipped_h200_paged_rule(monkeypatch):
    """The H200's shipped table turns REGS_SHAPE_RULES' paged fields (the page table and its early
    prefetch, measured faster on the H100 only) off for paged caches: its paged calls get what they
    got without those rules; contiguous caches keep the shape rules, and the H100 keeps all of them."""
    select.clear_cache()
    shapes = ((1, 16384), (1, 32768), (8, 8192), (8, 32768), (32, 8192))   # 1 x 8k: test_shipped_h200_paged_batch1_rule

    def choose(b, ctx, paged, gpu):
        return select.choose(_p(b, ctx, paged), CC, gpu, SMEM, family="decode_splitkv")[1]

    h200 = {s: (choose(*s, True, H200), choose(*s, False, H200)) for s in shapes}
    h100 = {s: choose(*s, True, H100) for s in shapes}
    assert any(c.regs_page_table for c in h100.values())
    contiguous_rules = tuple(r for r in mod.REGS_SHAPE_RULES if not r[0])
    monkeypatch.setattr(mod, "REGS_SHAPE_RULES", contiguous_rules)
    for s in shapes:
        assert h200[s][0] == choose(*s, True, H100), (s, h200[s][0].name)
        if s != (32, 8192):   # contiguous 32 x 8k: the H200's 4-warp rule (test_shipped_h200_batch_rules)
            assert h200[s][1] == choose(*s, False, H100), s
        assert not h200[s][0].regs_page_table and not h200[s][0].regs_prefetch, s


def test_shipped_h200_paged_batch1_rule():
    """The H200's paged batch-1 rule (session 31, dec28, issue 13): one batch row of at most 8192 keys in pages stages
    the whole table row (regs_page_table 2) on the paged batch-1 config, at pages 16 and 256 (call_config keeps it at
    large pages, where the table alone (1) is dropped); 16k keys, batch 2, contiguous caches, the H100 and calls
    other than the measured bf16 d 128 32:8 one-row class are untouched,
    and a row of more than REGS_PAGE_IDS pages (a given config raises naming block_table) falls back to 1."""
    select.clear_cache()

    def choose(b, ctx, paged, gpu):
        return select.choose(_p(b, ctx, paged), CC, gpu, SMEM, family="decode_splitkv")[1]

    for ctx in (8192, 4096, 1):
        cfg = choose(1, ctx, True, H200)
        assert cfg.regs_page_table == 2 and not cfg.regs_prefetch, (ctx, cfg.name)
        assert cfg.replace(regs_page_table=0) == choose(1, ctx, True, H100).replace(regs_page_table=0), (ctx, cfg.name)
        for page in (16, 256):
            got = FAM.call_config(cfg, _p(1, ctx, True), CC, page, chosen=True, heuristic=True)
            assert got.regs and got.regs_page_table == 2, (ctx, page, got.name)
    for b, ctx in ((1, 16384), (2, 8192)):
        assert not choose(b, ctx, True, H200).regs_page_table, (b, ctx)
    assert choose(1, 8192, False, H200) == choose(1, 8192, False, H100)
    assert choose(1, 8192, True, H100).regs_page_table != 2
    # only what was measured (bf16, d 128, 32:8 heads, one query row): fp16, other head layouts, d 64 and two
    # query rows keep the H200's paged rule (the table off)
    for other in (_p(1, 8192, True).replace(dtype="fp16"), _p(1, 8192, True).replace(nheads=8),
                  _p(1, 8192, True).replace(nheads=32, nheads_kv=32), _p(1, 8192, True, d=64),
                  _p(1, 8192, True).replace(seqlen_q=2)):
        got = select.choose(other, CC, H200, SMEM, family="decode_splitkv")[1]
        assert got.regs_page_table != 2, (other, got.name)
    cfg = choose(1, 8192, True, H200)
    big = _p(1, 16 * (mod.REGS_PAGE_IDS + 1), True)
    assert FAM.call_config(cfg, big, CC, 16, chosen=True, heuristic=True).regs_page_table == 1
    with pytest.raises(ValueError, match="block_table"):
        FAM.call_config(cfg, big, CC, 16, chosen=False)


def test_shipped_h200_batch_rules():
    """The H200's contiguous large-batch rules (session 30, issue 13): batch 32-64 at 4k-8k keys run 4 warps at 1
    split (two CTAs per SM), batch 32 from 64k keys 3 splits; neighbouring shapes, other head layouts, paged caches
    and the H100 keep the arch heuristic's config."""
    select.clear_cache()

    def choose(b, ctx, gpu, paged=False, heads=(32, 8)):
        p = Problem("decode", "bf16", b, 1, ctx, heads[0], heads[1], 128, False, False,
                    ("paged_kv",) if paged else ())
        return select.choose(p, CC, gpu, SMEM, family="decode_splitkv")[1]

    for b in (32, 64):
        cfg = choose(b, 8192, H200)
        assert (cfg.regs, cfg.warps, cfg.splits, cfg.regs_order, cfg.regs_prefetch) == (6, 4, 1, 1, True), cfg.name
        cfg = choose(b, 4096, H200)   # below REGS_SHAPE_RULES' 8k keys: no interleave / early prefetch
        assert (cfg.regs, cfg.warps, cfg.splits, cfg.regs_order, cfg.regs_prefetch) == (6, 4, 1, 0, False), cfg.name
    for ctx in (65536, 131072):
        cfg = choose(32, ctx, H200)
        assert (cfg.regs, cfg.warps, cfg.splits) == (6, 8, 3), cfg.name
    for b, ctx in ((32, 8192), (64, 4096), (32, 65536), (32, 131072)):
        assert choose(b, ctx, H100) == choose(b, ctx, "")
    untouched = [(16, 8192, {}), (32, 2048, {}), (32, 16384, {}), (32, 32768, {}), (64, 65536, {}), (64, 131072, {}),
                 (8, 131072, {}), (32, 8192, {"heads": (32, 32)}), (32, 8192, {"heads": (64, 8)})]
    for b, ctx, kw in untouched:
        assert choose(b, ctx, H200, **kw) == choose(b, ctx, "", **kw), (b, ctx, kw)
    paged = choose(32, 8192, H200, paged=True)
    assert paged.warps == 8 and not paged.splits, paged.name
