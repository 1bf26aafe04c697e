"""bench --mode features without SDPA math (62 ms a call at 8k: it alone would spend the device budget)."""
import sys
from cuflash.bench import features as F
orig = F.sdpa_support
F.sdpa_support = lambda case: {i: why for i, why in orig(case).items() if i != "sdpa_math"}
F.run(cases=F.DEFAULT_CASES, reps=5, out=sys.argv[1])
