"""The backward GPU grid (and the features' backward tests) with sm90_bwd's heuristic taking
dq_bulk=True: what the default path would run if the heuristic flipped."""
import sys
import pytest
from cuflash.families import sm90_bwd as m

orig = m.Sm90Backward.heuristic


def heuristic(self, problem, arch=(9, 0), max_smem=None):
    return orig(self, problem, arch, max_smem).replace(dq_bulk=True)


m.Sm90Backward.heuristic = heuristic
sys.exit(pytest.main(["-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/test_flash_bwd_gpu.py",
                      "tests/test_sm90_bwd_features_gpu.py", "-k", "sm90_bwd or features or window or softcap or alibi"]))
