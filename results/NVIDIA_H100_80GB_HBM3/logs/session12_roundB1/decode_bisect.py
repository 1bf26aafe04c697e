"""Bisect the round-A decode failure: b3 q1 ctx2049 h16x2 d64 fp16 split17 page16, non-causal."""
import sys, traceback
sys.path.insert(0, "tests")
import numpy as np
from cuflash import api, decode
from cuflash.families import decode_splitkv as fam
from test_decode_gpu import check_call, make_case
api.POISON_OUTPUTS = True
for (b, sq, ctx, h, hk, d, dt, splits, page) in [(3, 1, 2049, 16, 2, 64, "fp16", 17, 16), (3, 1, 2049, 16, 2, 64, "fp16", 17, None),
                                                (3, 1, 2049, 16, 2, 64, "fp16", 0, 16), (3, 1, 2049, 16, 2, 128, "fp16", 17, 16),
                                                (1, 1, 2049, 16, 2, 64, "bf16", 17, 16), (3, 1, 2049, 16, 2, 64, "fp16", 1, 16)]:
    for fused, pf in ((False, False), (True, False), (False, True), (True, True)):
        fam.FUSED_COMBINE_DEFAULT, fam.PAGE_PREFETCH_DEFAULT = fused, pf
        decode._drop_gpu_plans(); decode._gpu_plans = {}
        rng = np.random.default_rng(1)
        lens = [ctx] + [int(rng.integers(0, ctx + 1)) for _ in range(b - 1)]
        if b > 2: lens[2] = 0
        try:
            for call in range(2):
                args = make_case(rng, b, sq, lens, h, hk, d, dt, page=page, seqlen_new=1)
                check_call(args, dt, "x", causal=False, num_splits=splits)
            r = "ok"
        except AssertionError as e:
            r = "FAIL " + str(e).splitlines()[0][:150]
        except Exception as e:
            r = "ERR " + repr(e)[:200]
        print(f"b{b} ctx{ctx} h{h}x{hk} d{d} {dt} split{splits} page{page} lens{lens} fused={fused} prefetch={pf}: {r}", flush=True)
