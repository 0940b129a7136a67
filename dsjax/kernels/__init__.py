"""Every kernel dsjax has, one file per kernel, each beside its pure-jnp reference:

- `cpu`: the XLA:CPU vocabulary head (a C++ FFI custom call from `csrc/`, compiled on first use);
- `sink_attention`, `index_scores`, `grouped_matmul`: Pallas kernels (generic, interpretable on
  CPU) and Mosaic GPU kernels, with the dispatch the model calls;
- `stored_matmul`: Mosaic GPU kernels that read FP8 / MXFP4 weights as the checkpoint stores them;
- `mgpu`: the Mosaic GPU helpers they share; `dispatch`: which implementation a call takes.

Kernels see arrays and their own layouts, never the model's layers (tests/test_layering.py)."""
