"""Put a model behind the API: engine + engine loop + ASGI app, and run it with uvicorn.

    served = build(model, name="tiny", max_slots=8, capacity=4096)   # compiles every shape now
    served.app            # Starlette app (tests drive it in-process or behind uvicorn)
    run(served, host="127.0.0.1", port=8000)                          # blocks; `dsjax serve` does this
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from typing import Callable

import uvicorn

from dsjax.api import Model
from dsjax.engine import Engine
from dsjax.engine.constraints import ConstraintCompiler
from dsjax.engine.prefix_cache import PrefixCacheOptions
from dsjax.serving.app import create_app
from dsjax.serving.loop import EngineLoop
from dsjax.serving.metrics import Metrics
from dsjax.protocol import Context, Limits
from dsjax.tokenizer import Tokenizer, load_tokenizer
from dsjax.weights import bundled_models

# Top logprobs every served engine's programs compute per token (OpenAI's most top_logprobs),
# whatever max_logprobs lets requests ask for: servers started with and without logprobs run
# the same programs, which compute logprobs only in steps where a request asks (`Engine`).
LOGPROB_WIDTH = 20


@dataclasses.dataclass
class Served:
    app: object
    loop: EngineLoop
    engine: Engine
    ctx: Context
    metrics: Metrics

    http: uvicorn.Server | None = None  # set by run()

    def close(self) -> None:
        self.loop.stop()

    def shutdown(self, drain_timeout: float = 30.0) -> int:
        """Graceful stop: new requests get 503 (and /health says draining), those in flight
        finish for up to drain_timeout seconds, the rest are stopped with a terminal event
        in their API's shape (finish_reason length, then [DONE] / message_stop); then the
        HTTP server closes. Returns how many requests were stopped. Any thread."""
        stopped = self.loop.drain(drain_timeout)
        if self.http is not None:
            self.http.should_exit = True
        return stopped


def build(model: Model, *, name: str = "dsjax", tokenizer: Tokenizer | None = None, max_slots: int = 8,
          capacity: int = 4096, prefill_chunk: int = 256, decode_steps: int = 1, num_draft_tokens: int = 0,
          batch_invariant: bool | None = None, max_logprobs: int = 0, limits: Limits = Limits(),
          api_key: str | None = None, default_thinking: bool | None = None, max_thinking_tokens: int | None = None,
          warmup: bool = True, scoring: bool = False, on_warmup: Callable[[int, int, str], None] | None = None,
          prefix_cache: PrefixCacheOptions | None = None) -> Served:
    """The engine (its cache checked to fit, then allocated), warmed up unless warmup=False
    (then the first requests of each shape compile; on_warmup(i, total, what) hears of each
    program, `Engine.warmup`'s progress), its loop thread started, and the app. prefix_cache:
    the engine keeps prompts' cache blocks across requests (usage then reports the prompt
    tokens taken from it, as OpenAI's cached_tokens / Anthropic's cache_read_input_tokens).
    default_thinking: the thinking mode of requests that do not say; None: off for a model
    with no chat of its own (a bundled model: the built-in code model), else on (the
    recipe's default). max_logprobs: the most (prompt) logprobs a request may ask for; the
    engine's programs are the same whatever it says (up to LOGPROB_WIDTH). scoring: warmup
    also compiles the prefill programs that score prompts (echo with logprobs,
    prompt_logprobs; else compiled on their first request)."""
    if default_thinking is None:
        default_thinking = model.config.name not in bundled_models()
    engine = Engine(model, max_slots=max_slots, capacity=capacity, prefill_chunk=prefill_chunk,
                    decode_steps=decode_steps, num_draft_tokens=num_draft_tokens, batch_invariant=batch_invariant,
                    max_logprobs=max_logprobs, logprob_width=min(max(LOGPROB_WIDTH, max_logprobs), model.config.vocab_size),
                    prefix_cache=prefix_cache)
    structured = num_draft_tokens == 0  # the engine refuses grammar constraints with speculation
    if warmup:
        engine.warmup(constrained=structured, scoring=scoring, progress=on_warmup)
    tokenizer = tokenizer or load_tokenizer(model)
    compiler = ConstraintCompiler.for_model(model, tokenizer) if structured else None
    eos = tuple(model.config.eos_token_ids)
    ctx = Context((name,), tokenizer, eos, capacity, max_logprobs, limits, default_thinking=default_thinking,
                  compiler=compiler, max_thinking_tokens=max_thinking_tokens)
    metrics = Metrics(max_slots)
    loop = EngineLoop(engine, max_waiting=limits.max_waiting, metrics=metrics).start()
    return Served(create_app(loop, ctx, metrics, api_key), loop, engine, ctx, metrics)


class BackgroundServer:
    """uvicorn in a thread on an already bound socket (port 0: any free port): for tests,
    notebooks and benchmarks. `url` is where it listens; `stop()` shuts it down."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "BackgroundServer":
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread stopped before it started")
            threading.Event().wait(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def run(served: Served, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until `served.shutdown()` (`dsjax serve` calls it on SIGINT / SIGTERM; in the
    main thread uvicorn also handles those signals itself, without the drain)."""
    served.http = uvicorn.Server(uvicorn.Config(served.app, host=host, port=port, log_level=log_level,
                                                timeout_graceful_shutdown=5))
    try:
        served.http.run()
    finally:
        served.close()
