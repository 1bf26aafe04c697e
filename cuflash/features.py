"""Feature flags of the attention kernels: sliding window, softcap, ALiBi.

Each is a compile-time template parameter of a family's kernels (``kWindow``, ``kSoftcap``,
``kAlibi``, appended after the existing ones) and a bool field of its config (``window``,
``softcap``, ``alibi``: part of the config's name and kernel name, so of the compile cache and
the tuner's key through ``Problem.features``). A family lists the ones it implements in
``Family.features``; ``Family.supports`` refuses the others, so selection falls back.

The run-time values (window bounds, the cap, the slopes' address) are params-struct fields
(kernels_cu/params.cuh, appended at the end of each struct): ``feature_params`` gives the
per-shape ones; the slopes' address is written per call (``Plan.run_fields``).
"""
from __future__ import annotations

# Problem.features names that are kernel template flags, in template-parameter order.
KERNEL_FLAGS = ("window", "softcap", "alibi")


def flags_of(problem) -> dict:
    """{flag: bool} of a problem, for a config's fields."""
    return {f: f in problem.features for f in KERNEL_FLAGS}


def name_suffix(config) -> str:
    """'' for a plain config, else e.g. '_win_cap_alibi' (config names)."""
    short = {"window": "win", "softcap": "cap", "alibi": "alibi"}
    return "".join(f"_{short[f]}" for f in KERNEL_FLAGS if getattr(config, f, False))


def template_suffix(config) -> str:
    """', kWindow, kSoftcap, kAlibi' as C++ bools (the kernels default them to false)."""
    return "".join(f", {'true' if getattr(config, f, False) else 'false'}" for f in KERNEL_FLAGS)


def feature_params(problem, softmax_scale: float) -> dict:
    """The feature fields of FwdParams / BwdParams / Sm90FwdParams for one call shape (the
    slopes' address is 0 here: written per call)."""
    left, right = problem.window if "window" in problem.features else (-1, -1)
    cap = problem.softcap if "softcap" in problem.features else 0.0
    return dict(window_left=int(left), window_right=int(right),
                softcap_in=softmax_scale / cap if cap else 0.0,
                softcap_out=cap / softmax_scale if cap else 0.0,
                alibi_slopes=0,
                alibi_batch_stride=problem.nheads if problem.alibi_batched else 0)
