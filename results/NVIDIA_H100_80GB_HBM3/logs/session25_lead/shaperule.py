"""python shaperule.py HI -m MODULE ARGS...: run with the contiguous REGS_SHAPE_RULES entry (interleaved order +
3-block early prefetch) limited to batches 2..HI for the whole process (dec16 shipped HI = 64)."""
import runpy
import sys

from cuflash.families import decode_splitkv as ds

hi = int(sys.argv[1])
ds.REGS_SHAPE_RULES = tuple((paged, (lo, hi) if not paged else bs, ks, f)
                            for paged, (lo, h0), ks, f in ds.REGS_SHAPE_RULES for bs in [(lo, h0)])
print("REGS_SHAPE_RULES", ds.REGS_SHAPE_RULES, flush=True)
sys.argv = [sys.argv[3], *sys.argv[4:]]
runpy.run_module(sys.argv[0], run_name="__main__")
