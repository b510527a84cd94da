"""The jax-free core every other layer builds on.

``ir`` (values, equations, programs), ``mesh`` (named axes), ``sharding`` (how a value is laid
out), ``spmd`` (the lowered per-device program and its file format), ``dtypes`` (dtype names →
numpy), ``factors`` (the vocabulary of sharding rules) and ``registry`` (one entry per
primitive). Nothing here imports jax, mpi4py or any other layer of partir_emu.
"""
