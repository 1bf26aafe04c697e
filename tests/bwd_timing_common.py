"""What the backward timing scripts (tests/sm90_bwd_*_timing.py) share: compiling every kernel before
anything is timed, the first call of each candidate outside the timing, the relative difference of
two gradients, SDPA's backward as the reference, and the ending (summary, JSON). Not a test.

The scripts run by hand on the GPU (`python tests/sm90_bwd_d128_timing.py ...`) and put this folder
and the checkout on sys.path before they import it (and cuflash).
"""
import json
import time

import torch

from cuflash.bench.common import grad_fn
from cuflash.compile import precompile

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# --causal's value: the masks a script runs
CAUSALS = {"yes": (True,), "no": (False,), "both": (False, True)}


def compile_first(todo, title, t0, cudnn=True, verb="ready"):
    """Compile every kernel of `todo` (configs; a repeat once) in parallel processes before anything
    is timed (cuflash.compile.precompile fills CuPy's cache, so the timed calls only load), stop on
    any compile error, and print the script's header line: device, `title`, torch (and cuDNN)
    versions, how many kernels and the seconds since t0. Returns the kernels, repeats removed."""
    todo = list(dict.fromkeys(todo))
    errors = [(c.name, e) for c, _, e in precompile(todo) if e]
    assert not errors, errors
    versions = f"torch {torch.__version__}" + (f", cuDNN {torch.backends.cudnn.version()}" if cudnn else "")
    print(f"{torch.cuda.get_device_name()}  {title}, {versions}; {len(todo)} kernels {verb} in "
          f"{time.time() - t0:.0f} s", flush=True)
    return todo


def first_calls(fns: dict, optional=()) -> dict:
    """{name: gradients (dq, dk, dv)} of one call of each callable in `fns`, made outside the timing
    so that kernels load here and a NaN fails loudly. A name in `optional` (an SDPA backend this
    GPU or shape may lack) whose call raises RuntimeError is reported and dropped from fns."""
    results = {}
    for name, fn in list(fns.items()):
        try:
            g = fn()
        except RuntimeError as e:
            if name not in optional:
                raise
            print(f"{name}: skipped ({str(e).splitlines()[0][:120]})", flush=True)
            del fns[name]
            continue
        assert not any(x.isnan().any() for x in g), f"{name}: NaN in the gradients"
        results[name] = g
    torch.cuda.synchronize()
    return results


def rel(a, b):
    """max |a - b| over max |b|: the difference of a from the reference b, relative to b's scale."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def grad_diffs(got, ref):
    """(dq diff, dk / dv diff) of gradients `got` from `ref`, each relative (rel); dk and dv as the larger."""
    return rel(got[0], ref[0]), max(rel(got[1], ref[1]), rel(got[2], ref[2]))


def sdpa_fn(q, k, v, dout, causal, backend):
    """SDPA with one backend, (b, s, h, d) tensors viewed as (b, h, s, d); the backward alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def f(q, k, v):
        with sdpa_kernel(be):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)

    return grad_fn(f, q, k, v, dout)


def finish(summary, t0, out, dev, rows):
    """The timing scripts' ending: the summary lines, the total time, and the rows as JSON to `out` (with
    the device, torch and cuDNN versions and the FLOPs convention)."""
    print("\n".join(summary))
    print(f"total {time.time() - t0:.0f} s", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(dict(device=dev, torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                           convention="FA: bwd FLOPs = 2.5 x 4 b h s^2 d (/2 causal)", rows=rows), f, indent=1)
        print(f"wrote {out}")
