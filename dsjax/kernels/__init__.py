"""Every kernel dsjax has, one file per kernel, each beside its pure-jnp reference:

- `cpu`: the XLA:CPU vocabulary head (a C++ FFI custom call from `csrc/`, compiled on first use);
- `sink_attention`, `index_scores`, `grouped_matmul`: Pallas kernels (generic, interpretable on
  CPU) and Mosaic GPU kernels, with the dispatch the model calls;
- `tpu_attention`, `tpu_grouped_matmul`, `tpu_index_scores`: their Mosaic TPU kernels, tiled to
  VMEM (`tpu_candidate_scores`: V4.1's bf16 index scores with its candidate blocks' maxima,
  dispatched from `index_scores`); `tpu_blocks`: block sizes per TPU generation and VMEM budgets, `tpu_budget`: the budgets
  at a model's shapes;
- `stored_matmul`: Mosaic GPU kernels that read FP8 / MXFP4 weights as the checkpoint stores them;
- `mgpu`: the Mosaic GPU helpers they share; `dispatch`: which implementation a call takes, and
  how a kernel meets a mesh.

Kernels see arrays and their own layouts, never the model's layers (tests/test_layering.py)."""
