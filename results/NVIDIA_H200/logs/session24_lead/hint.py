"""python hint.py on|off SCRIPT_OR_-m MODULE ARGS...: run a decode timing with REGS_BATCH1_HINT as shipped (on) or
emptied (off) for the whole process."""
import runpy
import sys

if sys.argv[1] == "off":
    from cuflash.families import decode_splitkv

    decode_splitkv.REGS_BATCH1_HINT = ()
if sys.argv[2] == "-m":
    sys.argv = [sys.argv[3], *sys.argv[4:]]
    runpy.run_module(sys.argv[0], run_name="__main__")
else:
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
