"""Kernel families: one module per ``kernels_cu/<name>.cu`` (see ``cuflash.registry``).

Every module here except ``base`` is imported by the registry on first use; a module
registers its family with ``register(...)`` at its end.
"""
