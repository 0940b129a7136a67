"""`dsjax params`, `dsjax memory`, `dsjax cache`: the abstract reports (sizes from a config
alone; nothing is allocated). Registered by `dsjax.cli`; imports are lazy (start-up)."""

from __future__ import annotations

import json


def cmd_params(args, say) -> int:
    import jax.numpy as jnp

    from dsjax.config import load_config
    from dsjax.param_count import count_params, format_counts

    counts = count_params(load_config(args.config), jnp.dtype(args.dtype))
    print(json.dumps(counts, indent=2) if args.json else format_counts(counts))
    return 0


def cmd_memory(args, say) -> int:
    import jax
    import jax.numpy as jnp

    from dsjax.api import check_mesh_fits
    from dsjax.config import load_config
    from dsjax.model import model_specs
    from dsjax.model.v41 import engram_table_values, v41_model_specs
    from dsjax.sharding.rules import bytes_per_device, parse_mesh_spec

    cfg = load_config(args.config)
    sizes = parse_mesh_spec(args.mesh)
    check_mesh_fits(cfg, jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes)))  # load_model's own check
    specs = (model_specs if cfg.v41 is None else v41_model_specs)(cfg, jnp.dtype(args.dtype))
    report = bytes_per_device(specs, sizes)
    host = engram_table_values(cfg) * 264 // 256  # e4m3 values + one e8m0 scale per 32 (spec §5.5)
    if args.json:
        print(json.dumps({"config": cfg.name, "mesh": sizes, "bytes_per_device": report,
                          "total_per_device": sum(report.values()), "engram_host_bytes": host}, indent=2))
        return 0
    print(f"{cfg.name} on mesh {sizes} ({args.dtype}): weight bytes per device")
    for k, v in sorted(report.items(), key=lambda kv: -kv[1]):
        print(f"  {k:22s}{v / 2**30:10.2f} GiB")
    print(f"  {'total':22s}{sum(report.values()) / 2**30:10.2f} GiB")
    if host:
        print(f"  Engram tables stay in host memory (FP8 + E8M0, read by row): {host / 2**30:.2f} GiB per host")
    return 0


def context_lengths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        try:
            n = int(part)
        except ValueError:
            n = None
        if n is None or n < 1:
            raise ValueError(f"--context: context lengths must be positive integers, got {part.strip()!r} "
                             f"(e.g. --context 8192,131072)")
        out.append(n)
    return out


def cmd_cache(args, say) -> int:
    import jax.numpy as jnp

    from dsjax.config import load_config
    from dsjax.model.cache import cache_bytes

    contexts = context_lengths(args.context)
    cfg = load_config(args.config)
    rows = [cache_bytes(cfg, c, jnp.dtype(args.dtype)) for c in contexts]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{cfg.name}: decode cache per sequence ({args.dtype})")
    print(f"{'context':>10} {'per sequence':>14} {'per token':>11} {'compressed/token':>17} {'analytic min':>13} "
          f"{'full KV/token':>14}")
    for r in rows:
        print(f"{r['capacity']:>10} {r['bytes_per_sequence'] / 2**20:>11.1f} MiB {r['bytes_per_token']:>9.0f} B "
              f"{r['compressed_bytes_per_token']:>15.0f} B {r['analytic_min_bytes_per_token']:>11.0f} B "
              f"{r['full_kv_bytes_per_token']:>12.0f} B")
    if "compact_bytes_per_token" in rows[0]:
        print(f"compressed entries stored as the reference's formats (FP4 latents with E4M3 scales per 16, FP4 "
              f"index keys with E8M0 scales per 32): {rows[0]['compact_bytes_per_token']:.0f} B per token")
    return 0
