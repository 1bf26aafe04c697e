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
