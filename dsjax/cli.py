"""`dsjax` command line: generate text, chat, serve, inspect sizes, convert checkpoints.

This module holds the commands and their arguments; how a command runs (a worker thread,
Ctrl-C, one-line errors, crash reports) is dsjax/cli_runner.py. Imports of dsjax and JAX are
deferred into the commands: `dsjax --help` answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from dsjax.cli_reports import cmd_cache as _cmd_cache
from dsjax.cli_reports import cmd_memory as _cmd_memory
from dsjax.cli_reports import cmd_params as _cmd_params
from dsjax.cli_runner import UsageError, on_interrupt, run_command
from dsjax.weights import DEFAULT_MODEL, resolve

SIDE_FILES = ("draft_vocab.json", "tokenizer.json", "tokenizer_config.json", "training.json")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage block and exit 2 itself
        raise UsageError(f"{message} (see `{self.prog} --help`)")


@contextlib.contextmanager
def _compile_counter():
    """Counts of programs built (compiled or read from the persistent cache) and read from the cache meanwhile."""
    import jax

    counts = {"programs": 0, "cached": 0}

    def on_duration(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            counts["programs"] += 1

    def on_event(event, **kw):
        if event == "/jax/compilation_cache/cache_hits":
            counts["cached"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)


def _setup_cache(args):
    from dsjax.compile_cache import setup_compile_cache

    return setup_compile_cache("off" if args.no_compile_cache else args.compile_cache)


WEIGHT_DTYPE_HELP = ("bfloat16: the projection matrices stored in bf16 under float32 activations (half the bytes a "
                     "CPU decode step reads; dsjax.store_weights). Default: as --dtype")


def _load(args, say, **kw):
    """load_model with the command's flags, saying what it loads."""
    import dsjax
    from dsjax.api import resolve_dtype
    from dsjax.weights import bundled_path

    dtype = resolve_dtype(args.dtype).name
    narrow = getattr(args, "weight_dtype", None)
    if narrow is not None and dtype != "float32":
        raise ValueError(f"--weight-dtype {narrow} stores weights under float32 activations; --dtype is {dtype}")
    if Path(args.model).exists():
        what = f"{args.model} ({dtype})"
    elif bundled_path(args.model) is not None:
        what = f"{args.model} (trained weights shipped with dsjax, {dtype})"
    else:
        what = f"{args.model} (random weights, seed {args.seed}, {dtype})"
    say(f"loading {what} ...")
    t = time.perf_counter()
    model = dsjax.load_model(args.model, dtype=args.dtype, seed=args.seed, mesh=args.mesh or None,
                             kernels=args.kernels, progress=not args.quiet and Path(args.model).is_dir(), **kw)
    say(f"loaded in {time.perf_counter() - t:.1f} s")
    if narrow is not None:
        model = dsjax.store_weights(model, narrow)
        say(f"projection weights stored as {narrow}, activations float32")
    return model


def _compiling(say, cache) -> None:
    from dsjax.layers import cpu_kernels

    if cpu_kernels.needs_build():
        say("building the CPU vocabulary-head kernel (once on this machine) ...")
        say(f"CPU head kernel: {cpu_kernels.status()}")
    if cache.enabled:
        say(f"compiling (programs compiled before are read from the cache in {cache.directory}) ...")
    else:
        say("compiling (compile cache off) ...")


def _cmd_generate(args, say) -> int:
    cache = _setup_cache(args)
    with _compile_counter() as counts:
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
    model = _load(args, say, mtp=True if args.num_draft_tokens else None)
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

    _compiling(say, cache)
    engine = p.engine(model)
    results = p.run(engine, on_token)
    if stream:
        print(flush=True)
    return results, engine, (first or [None])[0]


def _cmd_chat(args, say) -> int:
    import dsjax
    from dsjax.chat import Chat

    cache = _setup_cache(args)
    model = _load(args, say)
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
            _compiling(say, cache)

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
    from dsjax.layers import cpu_kernels
    from dsjax.pallas_kernels.dispatch import resolve_kernels
    from dsjax.tokenizer import tokenizer_path

    cache = _setup_cache(args)
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

    _setup_cache(args)
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


def _cmd_serve(args, say) -> int:
    from dsjax.engine.prefix_cache import auto_options, options_from_mib
    from dsjax.serving.protocol import Limits
    from dsjax.serving.server import build, run

    if args.port < 0 or args.port > 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if not args.drain_timeout >= 0:
        raise UsageError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    api_key = args.api_key or os.environ.get("DSJAX_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        say(f"warning: serving on {args.host} without an API key: anyone who can reach it can use it "
            f"(--api-key KEY or $DSJAX_API_KEY)")
    limits = Limits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                    max_tokens=args.max_tokens, max_waiting=args.max_queue,
                    request_timeout=args.request_timeout or None)
    auto_prefix = args.prefix_cache_mb is None  # the default: sized once the model is loaded
    prefix_cache = options_from_mib(0 if auto_prefix else args.prefix_cache_mb,  # bad flags before the load
                                    0 if auto_prefix else args.prefix_host_mb)
    cache = _setup_cache(args)
    model = _load(args, say, mtp=True if args.num_draft_tokens else None)
    name = args.served_model_name or Path(args.model).name
    if auto_prefix:
        prefix_cache, line = auto_options(model, max_slots=args.max_slots, capacity=args.capacity,
                                          prefill_chunk=args.prefill_chunk, host_bytes=int(args.prefix_host_mb * 2**20))
        say(line)
    _compiling(say, cache)
    t = time.perf_counter()
    with _compile_counter() as counts:
        served = build(model, name=name, max_slots=args.max_slots, capacity=args.capacity,
                       prefill_chunk=args.prefill_chunk, decode_steps=args.decode_steps,
                       num_draft_tokens=args.num_draft_tokens, batch_invariant=args.batch_invariant or None,
                       max_logprobs=args.max_logprobs, limits=limits, api_key=api_key,
                       default_thinking={"on": True, "off": False}.get(args.thinking_default),
                       max_thinking_tokens=args.max_thinking_tokens, warmup=not args.no_warmup,
                       scoring=args.max_logprobs > 0,  # a server with logprobs serves evaluations: echo
                       prefix_cache=prefix_cache,
                       on_warmup=lambda i, n, what: say(f"compiling {i}/{n}: {what} ..."))
    say(f"ready in {time.perf_counter() - t:.1f} s ({counts['programs']} programs, {counts['cached']} from the "
        f"compile cache); serving {name!r} on http://{args.host}:{args.port} - OpenAI /v1/chat/completions, "
        f"/v1/completions, /v1/responses; Anthropic /v1/messages; /v1/models, /health, /metrics")
    stopped_by: list[int] = []

    def stop(signum: int) -> None:  # the first SIGINT / SIGTERM: drain, then close
        stopped_by.append(signum)
        say(f"{signal.Signals(signum).name}: draining {served.loop.in_flight} requests (up to "
            f"{args.drain_timeout:g} s; again to stop now)")
        ended = served.shutdown(args.drain_timeout)
        say(f"stopped {ended} requests at the drain timeout" if ended else "drained")

    on_interrupt(stop)
    run(served, args.host, args.port, log_level="warning" if args.quiet else "info")
    return 128 + stopped_by[0] if stopped_by else 0


def add_prefix_cache_args(parser, auto: bool = False) -> None:
    """--prefix-cache-mb / --prefix-host-mb (dsjax serve, with an automatic default; dsjax batch)."""
    parser.add_argument("--prefix-cache-mb", type=float, default=None if auto else 0, metavar="MIB",
                        help="keep prompts' cache blocks across requests in up to MIB of device memory (0: off"
                        + ("; default: half the memory left after the weights and slots" if auto else "")
                        + "). A block is --prefill-chunk "
                        "tokens, which must be a multiple of the largest compression ratio (128 for V4)")
    parser.add_argument("--prefix-host-mb", type=float, default=0, metavar="MIB", help="host-memory tier for the "
                        "blocks the device budget evicts (0: they are dropped)")


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--quiet", "-q", action="store_true", help="no progress messages on stderr")
    common.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    common.add_argument("--compile-cache", metavar="DIR", default=None,
                        help="keep compiled programs in DIR (default: $DSJAX_COMPILE_CACHE, else "
                             "~/.cache/dsjax/jax; a cache dir set in JAX is kept)")
    common.add_argument("--no-compile-cache", action="store_true", help="do not read or write compiled programs")

    p = _Parser(prog="dsjax", description="DeepSeek-V4 inference in JAX")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

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
        c.add_argument("--kernels", default="reference", choices=["reference", "auto", "pallas", "mosaic_gpu"],
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

    s = sub.add_parser("serve", parents=[common], help="serve a model over the OpenAI and Anthropic APIs "
                       "(also: python -m dsjax.serving)")
    s.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"checkpoint directory, bundled model or named config (default: {DEFAULT_MODEL})")
    s.add_argument("--served-model-name", default=None, help="the name clients ask for (default: the --model's "
                   "last path component)")
    s.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto (default): float32 on CPU, bfloat16 on GPU / TPU")
    s.add_argument("--weight-dtype", default=None, choices=["bfloat16"], help=WEIGHT_DTYPE_HELP)
    s.add_argument("--seed", type=int, default=0, help="init seed for named configs (random weights)")
    s.add_argument("--mesh", default="", help="device mesh, e.g. 'data=2,expert=4' (default: one device)")
    s.add_argument("--kernels", default="reference", choices=["reference", "auto", "pallas", "mosaic_gpu"])
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY or x-api-key); "
                   "default: $DSJAX_API_KEY, else none")
    s.add_argument("--max-slots", type=int, default=8, help="requests decoded at once")
    s.add_argument("--capacity", type=int, default=4096, help="tokens per request (prompt + output)")
    s.add_argument("--prefill-chunk", type=int, default=256)
    s.add_argument("--decode-steps", type=int, default=1, help="decode steps per dispatch (more: higher "
                   "throughput, burstier streams)")
    add_prefix_cache_args(s, auto=True)
    s.add_argument("--num-draft-tokens", type=int, default=0, help="speculative decoding with the MTP layer")
    s.add_argument("--batch-invariant", action="store_true", help="each request's logits bitwise independent of "
                   "its batch (docs/batch-invariance.md; slower decode)")
    s.add_argument("--max-logprobs", type=int, default=0, help="top logprobs a request may ask for (0: logprobs "
                   "refused)")
    s.add_argument("--thinking-default", choices=["on", "off", "auto"], default="auto",
                   help="thinking mode of requests that do not say (auto: off for the built-in code model, which "
                   "has no chat of its own; on, the recipe's default, for any other)")
    s.add_argument("--max-thinking-tokens", type=int, default=None, help="structured output and tools in thinking "
                   "mode: close the reasoning after N tokens so the constrained answer gets its turn (default: half "
                   "of a request's max_tokens; a request's thinking.budget_tokens overrides it)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may run (0: no limit)")
    s.add_argument("--drain-timeout", type=float, default=30.0, help="on SIGINT / SIGTERM: seconds requests in "
                   "flight may finish (new ones get 503) before they are stopped with a final event; a second "
                   "signal stops at once")
    s.add_argument("--max-body-bytes", type=int, default=4 << 20)
    s.add_argument("--max-prompt-tokens", type=int, default=None, help="default: capacity - 1")
    s.add_argument("--max-tokens", type=int, default=None, help="cap on a request's max_tokens (default: capacity)")
    s.add_argument("--no-warmup", action="store_true", help="compile shapes on first use instead of at start")
    s.set_defaults(func=_cmd_serve)

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

    add_parsers(sub, common, load=_load, setup_cache=_setup_cache, compiling=_compiling,
                prefix_cache_args=add_prefix_cache_args)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
