"""The runner of the helper kernels' precompile scripts (cross entropy, rotary, the norms, dense_act;
not a test): each module's name expressions compiled in a pool of spawned worker processes, which
fills CuPy's kernel cache (CUPY_CACHE_DIR) for the GPU tests and timing scripts that follow."""
import functools
import multiprocessing
import time


def compile_one(source: str, loader: str, exprs):
    """(first name, seconds, error or ''): one module of kernels_cu/<source>.cu through
    cuflash.compile's ``loader`` (get_helper_functions or get_helper_kernels)."""
    from cuflash import compile as compile_mod

    t0 = time.perf_counter()
    try:
        getattr(compile_mod, loader)(source, exprs, 0)
        return exprs[0], time.perf_counter() - t0, ""
    except Exception as exc:  # noqa: BLE001 - reported
        return exprs[0], time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"


def run(source: str, mods: list, processes: int, label: str, loader: str = "get_helper_functions") -> int:
    """Compiles every module of ``mods`` (tuples of name expressions), printing a line per module and
    a summary; returns the exit status (1 if any failed)."""
    t0 = time.perf_counter()
    failed = 0
    with multiprocessing.get_context("spawn").Pool(max(1, min(processes, len(mods)))) as pool:
        for name, seconds, error in pool.imap_unordered(functools.partial(compile_one, source, loader), mods):
            print(f"{name}: {seconds:.1f} s {error}", flush=True)
            failed += bool(error)
    print(f"{len(mods)} {label} modules in {time.perf_counter() - t0:.1f} s, {failed} failed")
    return 1 if failed else 0
