"""Parameter and byte counts from the declared specs (no allocation): `dsjax params`."""

from __future__ import annotations

from collections import defaultdict

import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig
from dsjax.layers.quantized import StoredFormat
from dsjax.model.cache_layout import cache_bytes
from dsjax.model.family import family_of
from dsjax.model.stored import weight_specs
from dsjax.params import spec_leaves, weight_group
from dsjax.sharding.rules import RULES, bytes_per_device


def _tally(tree, cfg: ModelConfig, copies: int = 1) -> dict:
    by_group: dict[str, int] = defaultdict(int)
    by_dtype: dict[str, int] = defaultdict(int)
    buffers = 0
    for path, spec in spec_leaves(tree):
        if np.issubdtype(np.dtype(spec.dtype), np.integer):
            buffers += spec.nbytes * copies
            continue
        by_group[weight_group(path)] += spec.size * copies
        by_dtype[str(jnp.dtype(spec.dtype))] += spec.nbytes * copies
    total = sum(by_group.values())
    routed = by_group["routed_experts"]
    active = total - routed + routed * cfg.num_experts_per_tok // cfg.n_routed_experts
    return {"total": total, "active": active, "by_group": by_group, "by_dtype": by_dtype, "buffers": buffers}


def count_params(cfg: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """Totals, per-token active counts and bytes by dtype, for the main model and with the
    MTP drafter layer(s).

    Active per token: every weight a token's forward reads, with the routed experts counted
    at num_experts_per_tok / n_routed_experts (the hash tables are integer buffers, not
    parameters). `active` counts the whole embedding matrix; `active_excluding_embedding`
    counts the one row a token reads."""
    family = family_of(cfg)
    main = _tally(family.param_specs(cfg, dtype), cfg)
    mtp = _tally(*family.drafter_tally(cfg, dtype))  # V4.1: the DSpark stages; Engram's tables live on the host
    by_dtype = defaultdict(int)
    for part in (main, mtp):
        for k, v in part["by_dtype"].items():
            by_dtype[k] += v
    return {
        "config": cfg.name,
        "total": main["total"],
        "active": main["active"],
        "active_excluding_embedding": main["active"] - main["by_group"]["embed"] + cfg.hidden_size,
        "total_with_mtp": main["total"] + mtp["total"],
        "active_with_mtp": main["active"] + mtp["active"],
        "by_group": dict(main["by_group"]),
        "bytes_by_dtype_with_mtp": dict(by_dtype),
        "bytes_with_mtp": sum(by_dtype.values()),
        "integer_buffer_bytes": main["buffers"],
        "engram_tables": family.host_table_values(cfg),
    }


def format_counts(c: dict) -> str:
    g = 1e9
    lines = [f"config {c['config']}",
             f"  total parameters      {c['total'] / g:10.3f} B   (with MTP {c['total_with_mtp'] / g:.3f} B)",
             f"  active per token      {c['active'] / g:10.3f} B   (excluding the embedding matrix "
             f"{c['active_excluding_embedding'] / g:.3f} B; with MTP {c['active_with_mtp'] / g:.3f} B)",
             "  main model by group"]
    for k, v in sorted(c["by_group"].items(), key=lambda kv: -kv[1]):
        lines.append(f"    {k:22s}{v / g:10.3f} B")
    lines.append("  bytes by dtype (with MTP)")
    for k, v in sorted(c["bytes_by_dtype_with_mtp"].items()):
        lines.append(f"    {k:22s}{v / 2**30:10.2f} GiB")
    lines.append(f"  integer buffers (hash tables) {c['integer_buffer_bytes'] / 2**20:.1f} MiB")
    if c.get("engram_tables"):
        lines.append(f"  Engram tables (host memory) {c['engram_tables'] / g:10.3f} B")
    return "\n".join(lines)


ENGRAM_ROW_BYTES_PER_VALUE = 264 / 256  # E4M3 values + one E8M0 scale per 32 (spec deepseek-v41.md §5.5)
KV_TOKENS, KV_SEQS = 4096, 64  # the memory report's default KV budget: 64 sequences of 4k tokens


def memory_report(cfg: ModelConfig, mesh: dict[str, int] | None = None, *, dtype=jnp.bfloat16,
                  quantized: str = "dequantize", fmt: StoredFormat | None = None, kv_tokens: int = KV_TOKENS,
                  kv_seqs: int = KV_SEQS, device_bytes: int | None = None) -> dict:
    """Bytes one device of `mesh` (axis sizes; none: one device) holds, from the declared specs
    (nothing is allocated): the weights by group, in `dtype` or (quantized="resident") as the
    release stores them (FP8 1 B + an E8M0 byte per tile, MXFP4 0.5 B + 1/32 B, the rest in
    `dtype`); the drafter (MTP / DSpark head); a KV budget of `kv_seqs` sequences of
    `kv_tokens` tokens (the decode cache and token history, the sequences split over the
    batch shards, as the engine splits its slots); and, with device_bytes, whether they fit.
    Engram's tables are host memory, reported apart as stored (FP8 + E8M0, read by row)."""
    mesh = {**{"data": 1, "expert": 1, "tensor": 1}, **(mesh or {})}
    ratio = cfg.max_compress_ratio
    if kv_tokens < 1 or kv_tokens % ratio or kv_seqs < 0:
        raise ValueError(f"KV budget: kv_tokens must be a positive multiple of {ratio} (the largest compression "
                         f"ratio) and kv_seqs >= 0, got {kv_tokens} x {kv_seqs}")
    specs, drafter = weight_specs(cfg, dtype, quantized, fmt)
    weights = bytes_per_device(specs, mesh)
    drafter_bytes = sum(bytes_per_device(drafter, mesh).values()) if drafter is not None else 0
    shards = 1
    for axis in RULES.mesh_axes("batch"):
        shards *= mesh.get(axis, 1)
    per_seq = cache_bytes(cfg, kv_tokens, dtype)["bytes_per_sequence"] + kv_tokens * 4  # + the token history
    kv = per_seq * -(-kv_seqs // shards)
    need = sum(weights.values()) + drafter_bytes + kv
    whole = sum(s.nbytes for _, s in spec_leaves((specs, drafter)))
    host = int(family_of(cfg).host_table_values(cfg) * ENGRAM_ROW_BYTES_PER_VALUE)
    return {"config": cfg.name, "mesh": mesh, "quantized": quantized, "dtype": str(jnp.dtype(dtype)),
            "bytes_per_device": weights, "drafter_bytes_per_device": drafter_bytes,
            "kv_budget": {"tokens": kv_tokens, "sequences": kv_seqs, "bytes_per_sequence": per_seq,
                          "batch_shards": shards, "bytes_per_device": kv},
            "need_per_device": need, "device_bytes": device_bytes,
            "fits": None if device_bytes is None else need <= device_bytes,
            "weights_total_bytes": whole, "engram_host_bytes": host, "checkpoint_bytes": whole + host}
