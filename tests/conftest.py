import warnings

import numpy as np
import pytest

from cuflash import _gpu


def pytest_collection_modifyitems(config, items):
    reason = _gpu.why_unavailable()
    if not reason:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class strict_fp:
    """Turn numpy floating point errors and any warning into exceptions (the reference tests:
    `from conftest import strict_fp`)."""

    def __enter__(self):
        self._err = np.errstate(all="raise")
        self._err.__enter__()
        self._warn = warnings.catch_warnings()
        self._warn.__enter__()
        warnings.simplefilter("error")
        return self

    def __exit__(self, *exc):
        self._warn.__exit__(*exc)
        return self._err.__exit__(*exc)
