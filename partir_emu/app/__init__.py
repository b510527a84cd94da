"""The application layer: the ``partir-emu`` command line, experiments, and report writing.

The only layer that imports every other one (compiler, runtime, hwmodels) and ``scenarios``.
Importing this package imports nothing else: MPI ranks import :mod:`.experiment` for their
inputs and must stay free of jax and of the command line.
"""
