"""`dsjax` command line: generate text, chat, serve, inspect sizes, convert checkpoints, batch jobs.

The top of the package: it registers every command. This module holds generate, chat, info
and convert and the parser; reports.py the abstract size reports; the front ends their own
commands (dsjax/serving/command.py: serve, dsjax/batch/command.py: batch, verify). How a
command runs (a worker thread, Ctrl-C, one-line errors, crash reports), the common flags and
loading are dsjax/command.py. Imports of dsjax and JAX are deferred into the commands.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from dsjax.cli.reports import cmd_cache as _cmd_cache
from dsjax.cli.reports import cmd_memory as _cmd_memory
from dsjax.cli.reports import cmd_params as _cmd_params
from dsjax.command import (WEIGHT_DTYPE_HELP, CommandParser, add_prefix_cache_args, common_flags, compile_counter,
                           compiling, load, run_command, setup_cache)
from dsjax.config import KERNELS
from dsjax.weights import DEFAULT_MODEL, resolve

SIDE_FILES = ("draft_vocab.json", "tokenizer.json", "tokenizer_config.json", "training.json")


def _cmd_generate(args, say) -> int:
    cache = setup_cache(args)
    with compile_counter() as counts:
        results, engine, first_token = _generate(args, say, cache)
    stream = len(args.text) == 1 and not (args.json or args.ids)
    for text, r in zip(args.text, results):
        if args.ids:
            print(json.dumps({"prompt_ids": r.prompt_ids, "new_ids": r.ids}))
        elif args.json:
            print(json.dumps({"prompt": text, **r.to_dict()}, ensure_ascii=False))
        elif not stream:
            print(r.text)
    if args.num_draft_tokens and engine is not None:
        m = engine.spec_metrics()
        print(f"speculation: {m['drafts_accepted']}/{m['drafts_proposed']} drafts accepted, "
              f"{m['tokens_per_row_step']:.2f} tokens per target step", file=sys.stderr)
    if first_token is not None:
        say(f"{sum(len(r.ids) for r in results)} tokens, {time.perf_counter() - first_token:.1f} s after the first; "
            f"{counts['programs']} programs: {counts['cached']} read from the compile cache, "
            f"{counts['programs'] - counts['cached']} compiled")
    return 0


def _generate(args, say, cache):
    """Load, compile and generate, streaming one prompt's text to stdout as it comes."""
    import dsjax
    from dsjax.generate import plan, sampling_params
    from dsjax.sharding.distributed import initialize

    settings = dict(min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                    presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                    stop_token_ids=args.stop_id, ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    sampling = (args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
    sampling_params(1, *sampling, **settings)  # refuse bad settings before a (possibly long) load
    initialize(args.coordinator, args.num_processes, args.process_id)
    model = load(args, say, mtp=True if args.num_draft_tokens else None)
    p = plan(model, args.text, *sampling, args.num_draft_tokens, args.spec_policy, stop=args.stop,
             tokenizer=dsjax.load_tokenizer(args.model), token_healing=args.token_healing, **settings)
    stream = len(args.text) == 1 and not (args.json or args.ids)
    start, first = time.perf_counter(), []

    def on_token(index, event, text):
        if not first:
            first.append(time.perf_counter())
            say(f"generating ... (first token after {first[0] - start:.1f} s)")
        if stream and text:
            sys.stdout.write(text)
            sys.stdout.flush()

    compiling(say, cache)
    engine = p.engine(model)
    results = p.run(engine, on_token)
    if stream:
        print(flush=True)
    return results, engine, (first or [None])[0]


def _cmd_chat(args, say) -> int:
    import dsjax
    from dsjax.chat import Chat

    cache = setup_cache(args)
    model = load(args, say)
    chat = Chat(model, dsjax.load_tokenizer(args.model), thinking=args.thinking, reasoning_effort=args.reasoning_effort,
                system=args.system, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_p=args.top_p, seed=args.seed)
    interactive = sys.stdin.isatty()
    if interactive:
        say("chat: one message per line; Ctrl-D ends")
    turn = 0
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        message = line.rstrip("\r\n")
        if not message.strip():
            continue
        turn += 1
        if turn == 1:
            compiling(say, cache)

        def on_delta(kind, text):
            if kind == "content":
                sys.stdout.write(text)
                sys.stdout.flush()
            elif not args.quiet:  # reasoning goes to stderr: stdout carries only the answers
                sys.stderr.write(text)
                sys.stderr.flush()

        reply = chat.send(message, on_delta)
        print(flush=True)
        if args.show_prompt_ids:
            print(json.dumps({"turn": turn, "prompt_ids": reply.prompt_ids, "ids": reply.ids,
                              "finish_reason": reply.finish_reason,
                              "reply": {"content": reply.content, "reasoning_content": reply.reasoning_content}},
                             ensure_ascii=False), file=sys.stderr, flush=True)
    return 0


def _cmd_info(args, say) -> int:
    import jax
    import jaxlib

    import dsjax
    from dsjax.config import named_configs
    from dsjax.kernels import cpu as cpu_kernels
    from dsjax.kernels.dispatch import resolve_kernels
    from dsjax.tokenizer import tokenizer_path

    cache = setup_cache(args)
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    info = {"dsjax": dsjax.__version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "backend": jax.default_backend(), "devices": f"{len(devices)} x {', '.join(kinds)}",
            "kernels (auto)": resolve_kernels("auto"), "cpu head kernel": cpu_kernels.describe(),
            "compile cache": cache.describe(), "tokenizer": str(tokenizer_path()),
            "named configs": ", ".join(named_configs())}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for k, v in info.items():
        print(f"{k:16s}{v}")
    return 0


def _cmd_convert(args, say) -> int:
    import dsjax
    from dsjax.checkpoint import orbax_io
    from dsjax.checkpoint.loader import checkpoint_format

    setup_cache(args)
    say(f"reading {args.src} ...")
    t = time.perf_counter()
    model = dsjax.load_model(args.src, dtype=args.dtype, quantized=args.quantized, mesh=args.mesh or None,
                             progress=not args.quiet)
    loaded = time.perf_counter() - t
    fmt = checkpoint_format(args.src)
    say(f"writing {args.dst} ...")
    orbax_io.save(model, args.dst, quantized=args.quantized, fp8_block=fmt.fp8_block, experts_fp4=fmt.experts_fp4)
    src = Path(resolve(args.src))
    for side in SIDE_FILES:  # what a checkpoint directory holds besides its weights and config
        if (src / side).is_file():
            shutil.copy2(src / side, Path(args.dst) / side)
    print(f"read {args.src} in {loaded:.1f} s; wrote orbax checkpoint {args.dst} in "
          f"{time.perf_counter() - t - loaded:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from dsjax.serving.command import add_parser as add_serve_parser  # dsjax serve

    common = common_flags()

    p = CommandParser(prog="dsjax", description="DeepSeek-V4 inference in JAX")
    sub = p.add_subparsers(dest="command", required=True, parser_class=CommandParser)

    def model_args(c, default_new: int):
        c.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"checkpoint directory, bundled model ({DEFAULT_MODEL}: trained, the default) or named "
                            "config (random weights): tiny, small, v4-flash, v4-pro")
        c.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto (default): float32 on CPU, bfloat16 on GPU / TPU")
        c.add_argument("--weight-dtype", default=None, choices=["bfloat16"], help=WEIGHT_DTYPE_HELP)
        c.add_argument("--seed", type=int, default=0, help="sampling seed (and init seed for named configs)")
        c.add_argument("--max-new-tokens", type=int, default=default_new)
        c.add_argument("--mesh", default="", help="device mesh, e.g. 'data=2,expert=4' (default: one device)")
        c.add_argument("--kernels", default="reference", choices=[*KERNELS, "auto"],
                       help="attention / MoE kernels (see `dsjax info` for what auto picks here)")

    g = sub.add_parser("generate", parents=[common], help="continue text prompts (streams one prompt's text)")
    g.add_argument("text", nargs="+", help="prompt text (several: one completion each)")
    model_args(g, 32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop at this text (cut from the output); repeatable")
    g.add_argument("--stop-id", action="append", type=int, metavar="ID", help="stop at this token id; repeatable")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS")
    g.add_argument("--no-token-healing", dest="token_healing", action="store_false",
                   help="feed the prompt's tokens as they are (default: the last one is backed off and the first "
                        "new token begins with its text, so `def f(n):` goes on as code does, with `):\n`)")
    g.add_argument("--logprobs", type=int, default=0, metavar="N", help="report each token's logprob and the top N "
                   "(shown with --json)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt: text, ids, finish_reason, usage, "
                   "logprobs")
    g.add_argument("--ids", action="store_true", help="print prompt and new token ids as JSON")
    g.add_argument("--num-draft-tokens", type=int, default=0,
                   help="speculative decoding: MTP drafts verified per step (0 = off)")
    g.add_argument("--spec-policy", default=None, choices=["confidence", "fixed"],
                   help="how many drafts each step verifies: from the drafter's confidence (default), or all "
                        "(the only choice for a batch-invariant model)")
    g.add_argument("--coordinator", default=None, help="multi-host: coordinator host:port (jax.distributed)")
    g.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    g.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    g.set_defaults(func=_cmd_generate)

    c = sub.add_parser("chat", parents=[common], help="talk to a model (prompts by deepseek-recipe); one message "
                       "per line of stdin")
    model_args(c, 256)
    c.add_argument("--thinking", action="store_true", help="thinking mode (reasoning on stderr, answer on stdout)")
    c.add_argument("--reasoning-effort", choices=["low", "high", "xhigh", "max"], default=None,
                   help="thinking mode's effort (the recipe's)")
    c.add_argument("--system", default=None, help="a system prompt")
    c.add_argument("--temperature", type=float, default=None, help="default: the recipe's (1.0)")
    c.add_argument("--top-p", type=float, default=None, help="default: the recipe's (1.0)")
    c.add_argument("--show-prompt-ids", action="store_true",
                   help="after each turn, one JSON line on stderr: the prompt ids sent and the reply")
    c.set_defaults(func=_cmd_chat)

    add_serve_parser(sub, common)

    i = sub.add_parser("info", parents=[common], help="backend, devices, versions, kernels, compile cache")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_info)

    def report(name, help, func):  # the abstract reports: nothing is allocated
        r = sub.add_parser(name, help=help, parents=[common])
        r.add_argument("--config", default="v4-flash", help="named config, config JSON, or checkpoint dir")
        r.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
        r.add_argument("--json", action="store_true")
        r.set_defaults(func=func)
        return r

    report("params", "parameter counts and bytes (abstract, nothing allocated)", _cmd_params)
    report("cache", "decode-cache bytes per sequence and per token (abstract)", _cmd_cache).add_argument(
        "--context", default="8192,131072,1048576", help="comma-separated context lengths")

    v = sub.add_parser("convert", parents=[common], help="safetensors checkpoint -> sharded orbax checkpoint")
    v.add_argument("src", help="checkpoint directory (config.json + safetensors)")
    v.add_argument("dst", help="output directory")
    v.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    v.add_argument("--quantized", default="dequantize", choices=["dequantize", "resident"],
                   help="FP8 / MXFP4 checkpoints: dequantize, or keep the stored bytes")
    v.add_argument("--mesh", default="", help="write from (and for) this mesh, e.g. 'expert=8'")
    v.set_defaults(func=_cmd_convert)

    mem = report("memory", "weight + KV bytes per device on a mesh, and whether they fit (abstract)", _cmd_memory)
    mem.add_argument("--mesh", default="expert=8", help="e.g. 'data=2,expert=4,tensor=2'")
    mem.add_argument("--quantized", default="dequantize", choices=["dequantize", "resident"],
                     help="weights in --dtype, or as the release stores them (FP8 / MXFP4 + E8M0 scales)")
    mem.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                     help="a device's memory: say whether weights + the KV budget fit (exit 1 if not)")
    mem.add_argument("--kv-tokens", type=int, default=4096, help="KV budget: tokens per sequence (default 4096)")
    mem.add_argument("--kv-seqs", type=int, default=64, help="KV budget: sequences (default 64)")
    from dsjax.batch.command import add_parsers  # dsjax batch, dsjax verify

    add_parsers(sub, common, load=load, setup_cache=setup_cache, compiling=compiling,
                prefix_cache_args=add_prefix_cache_args)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser, sys.argv[1:] if argv is None else list(argv))

