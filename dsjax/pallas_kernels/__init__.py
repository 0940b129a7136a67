"""Pallas kernels, one file per kernel: the kernels, their pure-jnp reference and the one
dispatch the model calls (`sink_attention`, `index_scores`, `grouped_ffn`), which picks an
implementation by dispatch.py's rule."""
