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
    from dsjax.param_count import memory_report
    from dsjax.sharding.rules import parse_mesh_spec

    cfg = load_config(args.config)
    sizes = parse_mesh_spec(args.mesh)
    check_mesh_fits(cfg, jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes)))  # load_model's own check
    if args.device_memory is not None and args.device_memory <= 0:
        raise ValueError(f"--device-memory: a device's memory in GiB must be positive, got {args.device_memory}")
    device = None if args.device_memory is None else int(args.device_memory * 2**30)
    r = memory_report(cfg, sizes, dtype=jnp.dtype(args.dtype), quantized=args.quantized,
                      fmt=_checkpoint_format(args.config, cfg), kv_tokens=args.kv_tokens, kv_seqs=args.kv_seqs,
                      device_bytes=device)
    if args.json:
        print(json.dumps(r, indent=2))
        return _verdict(r, args.quantized, quiet=True)
    kind = "as stored (FP8 / MXFP4 + E8M0 scales)" if args.quantized == "resident" else args.dtype
    print(f"{cfg.name} on mesh {sizes}, weights {kind}: bytes per device")
    for k, v in sorted(r["bytes_per_device"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:22s}{v / 2**30:10.2f} GiB")
    if r["drafter_bytes_per_device"]:
        print(f"  {'drafter (MTP / DSpark)':22s}{r['drafter_bytes_per_device'] / 2**30:10.2f} GiB")
    kv = r["kv_budget"]
    print(f"  {'KV budget':22s}{kv['bytes_per_device'] / 2**30:10.2f} GiB   ({kv['sequences']} sequences x "
          f"{kv['tokens']} tokens over {kv['batch_shards']} batch shards; --kv-seqs, --kv-tokens)")
    print(f"  {'total':22s}{r['need_per_device'] / 2**30:10.2f} GiB")
    if r["engram_host_bytes"]:
        print(f"  Engram tables stay in host memory as stored (FP8 + E8M0 per 32, memory-mapped, read by row): "
              f"{r['engram_host_bytes'] / 2**30:.2f} GiB per host")
    print(f"whole model: {r['weights_total_bytes'] / 1e9:.1f} GB of weights on devices"
          + (f" + {r['engram_host_bytes'] / 1e9:.1f} GB of Engram tables on the host = "
             f"{r['checkpoint_bytes'] / 1e9:.1f} GB" if r["engram_host_bytes"] else ""))
    return _verdict(r, args.quantized)


def _verdict(r: dict, quantized: str, quiet: bool = False) -> int:
    """With --device-memory: "fits" on stdout, or a MemoryError naming the bytes (exit status 2)."""
    from dsjax.memory import show_bytes

    if r["fits"] is None:
        return 0
    need, have = r["need_per_device"], r["device_bytes"]
    if not r["fits"]:
        raise MemoryError(f"weights + KV budget need {show_bytes(need)} ({need} B) on each device, but a device holds "
                          f"{show_bytes(have)} ({have} B); use a larger mesh"
                          f"{', --quantized resident' if quantized != 'resident' else ''} or a smaller KV budget "
                          f"(--kv-seqs, --kv-tokens)")
    if not quiet:
        print(f"fits: {show_bytes(need)} of a device's {show_bytes(have)} ({show_bytes(have - need)} left)")
    return 0


def _checkpoint_format(config: str, cfg):
    """A checkpoint directory's declared FP8 tiles / expert format (None: the release's)."""
    from pathlib import Path

    from dsjax.checkpoint.loader import checkpoint_format
    from dsjax.layers.quantized import StoredFormat
    from dsjax.model.stored import stored_format

    path = Path(config)
    if path.name == "config.json":
        path = path.parent
    if not (path / "config.json").is_file() or "quantization_config" not in (path / "config.json").read_text():
        return None
    fmt = checkpoint_format(path)
    return StoredFormat(fmt.fp8_block, stored_format(cfg).fp8_linears, fmt.experts_fp4)


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
    from dsjax.model.cache_layout import cache_bytes

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
