"""CUDA C++ sources of the cuflash kernels (data files, compiled at run time)."""
