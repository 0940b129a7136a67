"""Each Mosaic TPU kernel's VMEM budget at a model's shapes, per TPU generation, against the
generation's scoped VMEM limit (tpu_blocks.py). The budgets come from the kernels' own block
plans (`vmem` in each tpu_*.py), so what is checked is what runs.

`python -m dsjax.kernels.tpu_budget` prints the table in docs/kernels.md.
"""

from __future__ import annotations

import functools

from dsjax.kernels import tpu_attention, tpu_candidate_scores, tpu_grouped_matmul, tpu_index_scores
from dsjax.kernels.tpu_blocks import GENERATIONS, SCOPED_VMEM

DECODE_BATCH, PREFILL_CHUNK, CONTEXT = 32, 256, 1 << 20  # one decode step of 32 rows; 1M tokens of context
# The FP8 blocks of the tabulated releases (spec deepseek-v4.md "Weight names", deepseek-v41.md
# §7.3); each generation's StoredFormat names its own (tests/test_mosaic_tpu.py checks they agree).
FP8_BLOCKS = {"v4-flash": (128, 128), "v4-pro": (128, 128), "v41-flash": (32, 32)}
CANDIDATE_BLOCKS = {"v41-flash": 8}  # V4.1's candidate blocks (deepseek-v41.md §2.8); V4 has none


def kernel_shapes(cfg, fp8_block=(128, 128), candidate_block: int | None = None) -> dict[str, tuple]:
    """The cases checked for a model config (reads its attention, indexer and MoE widths) with
    routed experts stored FP8 in `fp8_block` blocks, and (a V4.1 model) its candidate blocks of
    `candidate_block` entries: name -> (vmem function, its shape arguments)."""
    h, d, w = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    hca_entries = CONTEXT // cfg.compress_rate_hca
    topk, ih, idim = cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim
    csa_entries = CONTEXT // cfg.compress_rate_csa
    hidden, inter, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    b, s = DECODE_BATCH, PREFILL_CHUNK
    mxfp4 = functools.partial(tpu_grouped_matmul.vmem, mxfp4=True)  # the stored experts, dequantized in VMEM
    fp8 = functools.partial(tpu_grouped_matmul.vmem, fp8=tuple(fp8_block))
    cases = {
        "attention, decode, HCA": (tpu_attention.vmem, (b, 1, h, d, w + 1 + hca_entries, 0)),
        "attention, decode, CSA top-k": (tpu_attention.vmem, (b, 1, h, d, w + 1, topk)),
        "attention, prefill chunk, CSA top-k": (tpu_attention.vmem, (2, s, h, d, w + s, topk)),
        "grouped FFN, decode": (tpu_grouped_matmul.vmem, (b * k, hidden, inter)),
        "grouped FFN, prefill chunk": (tpu_grouped_matmul.vmem, (2 * s * k, hidden, inter)),
        "grouped FFN, MXFP4 experts, decode": (mxfp4, (b * k, hidden, inter)),
        "grouped FFN, MXFP4 experts, prefill chunk": (mxfp4, (2 * s * k, hidden, inter)),
        "grouped FFN, FP8 experts, decode": (fp8, (b * k, hidden, inter)),
        "grouped FFN, FP8 experts, prefill chunk": (fp8, (2 * s * k, hidden, inter)),
        "indexer scores, decode": (tpu_index_scores.vmem, (b, 1, ih, idim, csa_entries)),
        "indexer scores, prefill chunk": (tpu_index_scores.vmem, (2, s, ih, idim, csa_entries)),
    }
    if candidate_block:  # V4.1: its bf16 scores with the candidate blocks' maxima
        fn = functools.partial(tpu_candidate_scores.vmem, block=candidate_block)
        cases["candidate scores, decode"] = (fn, (b, 1, ih, idim, csa_entries))
        cases["candidate scores, prefill chunk"] = (fn, (2, s, ih, idim, csa_entries))
    return cases


def budgets(cfg, fp8_block=(128, 128), candidate_block: int | None = None) -> dict[str, dict[str, int]]:
    """case -> generation -> VMEM bytes (bf16 operands)."""
    return {name: {gen: fn(*args, gen=gen) for gen in GENERATIONS}
            for name, (fn, args) in kernel_shapes(cfg, fp8_block, candidate_block).items()}


def markdown(named_cfgs: dict) -> str:
    gens = " | ".join(f"{g} (limit {SCOPED_VMEM[g] >> 20})" for g in GENERATIONS)
    lines = [f"| model | kernel | {gens} |", "|---|---|" + "---|" * len(GENERATIONS)]
    for model, cfg in named_cfgs.items():
        for name, per_gen in budgets(cfg, FP8_BLOCKS.get(model, (128, 128)), CANDIDATE_BLOCKS.get(model)).items():
            lines.append(f"| {model} | {name} | " + " | ".join(f"{per_gen[g] / (1 << 20):.1f}" for g in GENERATIONS)
                         + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    from dsjax.config import load_config

    print(markdown({name: load_config(name) for name in FP8_BLOCKS}))
