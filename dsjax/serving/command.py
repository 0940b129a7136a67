"""`dsjax serve` (also `python -m dsjax.serving`): the parser and the command. dsjax/cli/
registers it (`add_parser`) beside the other commands; `main` runs it alone, so the module
entry needs no CLI. What every command shares (how it runs, loading, the compile cache) is
dsjax/command.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from dsjax.command import (WEIGHT_DTYPE_HELP, CommandParser, UsageError, add_prefix_cache_args, common_flags,
                           compile_counter, compiling, load, on_interrupt, run_command, setup_cache)
from dsjax.config import KERNELS
from dsjax.engine.prefix_cache import auto_options, options_from_mib
from dsjax.protocol import Limits
from dsjax.serving.server import build, run
from dsjax.weights import DEFAULT_MODEL


def add_parser(sub, common) -> None:
    """`dsjax serve` on a command line's subparsers (common: the flags every command takes)."""
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
    s.add_argument("--kernels", default="reference", choices=[*KERNELS, "auto"])
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
                   "refused); up to 20 it changes no compiled program")
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
    s.set_defaults(func=serve)


def serve(args, say) -> int:
    """Load, warm up and serve until SIGINT / SIGTERM (the first drains, a second stops at once)."""
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
    cache = setup_cache(args)
    model = load(args, say, mtp=True if args.num_draft_tokens else None)
    name = args.served_model_name or Path(args.model).name
    if auto_prefix:
        prefix_cache, line = auto_options(model, max_slots=args.max_slots, capacity=args.capacity,
                                          prefill_chunk=args.prefill_chunk, host_bytes=int(args.prefix_host_mb * 2**20))
        say(line)
    compiling(say, cache)
    t = time.perf_counter()
    with compile_counter() as counts:
        served = build(model, name=name, max_slots=args.max_slots, capacity=args.capacity,
                       prefill_chunk=args.prefill_chunk, decode_steps=args.decode_steps,
                       num_draft_tokens=args.num_draft_tokens, batch_invariant=args.batch_invariant or None,
                       max_logprobs=args.max_logprobs, limits=limits, api_key=api_key,
                       default_thinking={"on": True, "off": False}.get(args.thinking_default),
                       max_thinking_tokens=args.max_thinking_tokens, warmup=not args.no_warmup,
                       prefix_cache=prefix_cache,  # prompt-scoring programs: compiled on first use (docs/serving.md)
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


def main(argv: list[str]) -> int:
    """`python -m dsjax.serving [flags]` = `dsjax serve [flags]`."""
    def build_parser():
        p = CommandParser(prog="dsjax", description="DeepSeek-V4 inference in JAX")
        add_parser(p.add_subparsers(dest="command", required=True, parser_class=CommandParser), common_flags())
        return p

    return run_command(build_parser, ["serve", *argv])
