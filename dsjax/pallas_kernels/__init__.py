"""Pallas kernels, one file per kernel: the kernel, its pure-jnp reference (from
dsjax/layers) and the dispatch that picks one per backend."""
