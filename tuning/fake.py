"""A deterministic stand-in for ``GpuMeasure``: the tuner end to end without a GPU.

Used by the CPU tests (so optuna's integration runs in CI) and handy for trying the
study machinery. Times follow a made-up smooth model with one best point, plus a fixed
per-config wobble; chosen points can be made to fail with a given status.
"""
from __future__ import annotations

import hashlib
import math
import os
import signal
from typing import Optional

from .objective import OK, TrialResult


def model_ms(config) -> float:
    """Made-up time: best at Br=128, Bc=64, 4 warps, 2 stages, dsplit 1; ~1 ms."""
    def dist(name, best):
        value = getattr(config, name, best)
        return abs(math.log2(value / best))

    ms = 1.0 + 0.09 * dist("Br", 128) + 0.05 * dist("Bc", 64) + 0.07 * dist("warps", 4) \
        + 0.03 * dist("stages", 2) + 0.04 * dist("dsplit", 1)
    wobble = int(hashlib.sha1(config.name.encode()).hexdigest()[:6], 16) % 1000 / 1e5
    return ms + wobble


class FakeMeasure:
    """``measure(config) -> TrialResult`` from ``model_ms``.

    fail:       {config name: status} for points that should fail (e.g. "wrong")
    kill_on:    SIGKILL this process on that call number (1-based): a killed tuner
    interrupt_on: raise KeyboardInterrupt on that call number: Ctrl-C
    calls:      the configs measured, in order
    """

    def __init__(self, fail: Optional[dict] = None, kill_on: Optional[int] = None,
                 interrupt_on: Optional[int] = None, fatal_on: Optional[int] = None):
        self.fail = dict(fail or {})
        self.kill_on, self.interrupt_on, self.fatal_on = kill_on, interrupt_on, fatal_on
        self.calls: list = []
        self.fatal = ""

    def __call__(self, config) -> TrialResult:
        self.calls.append(config)
        n = len(self.calls)
        if n == self.kill_on:
            os.kill(os.getpid(), signal.SIGKILL)
        if n == self.interrupt_on:
            raise KeyboardInterrupt
        if n == self.fatal_on:
            self.fatal = "fake sticky CUDA error"
        status = self.fail.get(config.name)
        if status:
            return TrialResult(status, reason=f"fake {status}", compile_s=0.0)
        return TrialResult(OK, model_ms(config), compile_s=0.0, extra={"fake": True})


class FakeCompareMeasure(FakeMeasure):
    """A FakeMeasure with ``compare`` (as GpuMeasure's): the configs re-timed together, by
    ``model_ms`` unless ``confirm_ms`` ({config name: ms}) says otherwise (a study whose
    sequential times disagree with the interleaved re-time)."""

    def __init__(self, confirm_ms: Optional[dict] = None, **kw):
        super().__init__(**kw)
        self.confirm_ms = dict(confirm_ms or {})
        self.compared: list = []

    def compare(self, configs, reps=None) -> dict:
        self.compared.append(list(configs))
        return {c: self.confirm_ms.get(c.name, model_ms(c)) for c in configs}
