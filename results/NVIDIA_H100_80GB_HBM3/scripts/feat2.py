"""bench --mode features, cuflash vs its plain call only (SDPA's masked backends take 0.2-0.5 s a sample at 8k)."""
import sys
from cuflash.bench import features as F
F.sdpa_support = lambda case: {}
F.run(cases=F.DEFAULT_CASES, reps=3, out=sys.argv[1])
