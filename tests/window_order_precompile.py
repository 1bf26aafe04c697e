"""Precompile (parallel NVRTC) every kernel of session 23's window work: tests/test_window_order_gpu.py's,
tests/window_bwd_kernels_timing.py's, window_accounting_timing's (forward) and features_overhead_timing --quick
--mask both --features window's (--fwd-tests: only the tests' forward kernels).
Needs a GPU (the selection's plain configs).

    timeout 90 python tests/window_order_precompile.py
"""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]


def main():
    from cuflash.compile import precompile

    import features_overhead_timing as feat
    import test_window_order_gpu as tests
    import window_bwd_kernels_timing as bwdk

    import window_accounting_timing as acc

    cfgs = (feat.all_configs(quick=True, mask="both", features=("window",)) + [c for _, _, c in bwdk.configs().values()]
            + [c for _, c in acc.configs().values()]
            + ([] if "--timing-only" in sys.argv else [c for c in tests.all_test_configs()
                                                      if "--fwd-tests" not in sys.argv or c.family == "sm90_fwd"]))
    res = precompile(list(dict.fromkeys(cfgs)))
    print(f"compiled {len(res)}; failed: {[(c.name, e[:300]) for c, _, e in res if e]}; "
          f"slowest {max(s for _, s, _ in res):.0f} s")


if __name__ == "__main__":
    main()
