"""The CPU checks every helper kernel module (cross entropy, rotary, the norms, dense_act) runs with
nvcc: its instantiations compile for an arch without spills, and its packed params struct
(``cuflash.launch.struct_dtype``) has nvcc's layout. Skipped without nvcc."""
import shutil
import subprocess

import pytest

from cuflash.compile import kernel_dir, parse_ptxas, render_source
from cuflash.launch import struct_dtype

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def ptxas_reports(tmp_path, module: str, params: str, names, arch: str):
    """Compiles ``kernels_cu/<module>.cu`` with an explicit instantiation of each kernel name (each
    taking ``const cuflash::<params>``) for arch; asserts it compiled and that ptxas reported every
    kernel; returns the reports."""
    lines = [render_source(module)]
    lines += [f"template __global__ void {n}(const cuflash::{params});" for n in names]
    src = tmp_path / f"{module}.cu"
    src.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([NVCC, "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v",
                           "-o", str(tmp_path / "k.cubin"), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    reports = parse_ptxas(proc.stderr + proc.stdout)
    assert len(reports) == len(names)
    return reports


def assert_params_layout(tmp_path, params: str, header: str):
    """nvcc's sizeof / offsetof of ``cuflash::<params>`` (from ``kernels_cu/<header>``) equal
    struct_dtype's; returns the dtype."""
    dt = struct_dtype(params)
    checks = [f"static_assert(sizeof(cuflash::{params}) == {dt.itemsize}, \"sizeof\");"]
    checks += [f"static_assert(__builtin_offsetof(cuflash::{params}, {n}) == {dt.fields[n][1]}, \"{n}\");"
               for n in dt.names]
    src = tmp_path / "layout.cu"
    src.write_text(f'#include "{header}"\n' + "\n".join(checks) + "\n")
    proc = subprocess.run([NVCC, "-cubin", "-arch=sm_80", "-std=c++17", f"-I{kernel_dir()}",
                           "-o", str(tmp_path / "l.cubin"), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return dt
