"""Fill CuPy's kernel cache, in parallel worker processes, with the kernels that the
generation_cg GPU round compiles (not a test; run it first so that the tests and the timing find
their kernels on disk): per model shape and dtype a one-layer model of that shape runs the
prompt's forward, eager decode steps (cg=False) and the graph's warm-up steps (cg=True) at every
(batch, prompt, max_length) the round uses, and the no-cache forward of the GPU tests.

    CUPY_CACHE_DIR=/tmp/cupy_cache python tests/generation_cg_precompile.py [--processes 8] [--only timing|tests]
"""
import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

TIMING = [(1, 128, 384), (8, 128, 384)]
TESTS = [(3, 9, 40), (1, 7, 30), (3, 7, 24), (5, 7, 40)]
JOBS = [("timing", name, "bf16", TIMING) for name in ("gpt2", "llama1b")] + \
       [("tests", name, dt, TESTS) for name in ("gpt2", "llama_gqa_rotary") for dt in ("bf16", "fp16")]


def job(kind, name, dtype_name, cells):
    import torch

    from cuflash.models.gpt import GPT2Config, GPTLMHeadModel

    t0 = time.time()
    if kind == "timing":
        import generation_cg_timing as timing
        model = timing.build(name, n_layer=1)
        vocab = timing.CONFIGS[name]["vocab_size"]
    else:
        import test_generation_cg_gpu as t
        cfg = GPT2Config(**{**t.COMMON, **t.CONFIGS[name], "n_layer": 1, "use_flash_attn": True})
        model = GPTLMHeadModel(cfg, device="cuda", dtype=t.DTYPES[dtype_name]).eval()
        vocab = 1000
    for batch, prompt_len, max_length in cells:
        prompt = torch.randint(0, vocab, (batch, prompt_len), device="cuda")
        seq = model.generate(prompt, max_length)
        model.generate(prompt, max_length, cg=True)
        if kind == "tests":
            with torch.no_grad():
                model(seq)
    torch.cuda.synchronize()
    return f"{kind} {name} {dtype_name}: {time.time() - t0:.1f} s"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--only", default="", help="timing or tests: that kind of job only")
    args = ap.parse_args()
    jobs = [j for j in JOBS if not args.only or j[0] == args.only]
    t0 = time.time()
    with ProcessPoolExecutor(args.processes, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(job, *j) for j in jobs]
        for f in as_completed(futures):
            print(f.result(), flush=True)
    print(f"precompiled in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
