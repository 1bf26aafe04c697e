"""python rules.py on|off -m MODULE ARGS...: run with dec16's REGS_SHAPE_RULES as shipped (on) or emptied (off)
for the whole process (session 25: the rules were timed on the H100 only)."""
import runpy
import sys

from cuflash.families import decode_splitkv as ds

if sys.argv[1] == "off":
    ds.REGS_SHAPE_RULES = ()
sys.argv = [sys.argv[3], *sys.argv[4:]]
runpy.run_module(sys.argv[0], run_name="__main__")
