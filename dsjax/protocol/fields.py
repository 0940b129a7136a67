"""What every served API shares: the error, the server's limits and context, a request's
choices and job, the APIs themselves, and the checks and sampling fields read from a body
before any conversion."""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from typing import Any, Callable

import deepseek_recipe as recipe

from dsjax.engine import SamplingParams
from dsjax.engine.sampler import MAX_LOGIT_BIAS, is_real
from dsjax.tokenizer import Tokenizer


MODEL_VERSIONS = {"v4": recipe.ModelVersion.DeepseekV4Pro, "v4.1": recipe.ModelVersion.DeepseekV41Flash}


class APIError(Exception):
    """An error answered as JSON in the API's own shape (`app.error_response`)."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask for (each refused with a 4xx naming the limit)."""

    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None  # default: the engine's capacity - 1
    max_tokens: int | None = None  # default: the engine's capacity
    max_prompts: int = 16  # /v1/completions: prompts per request
    max_samples: int = 16  # `n`: samples per prompt (Chat Completions, Completions)
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 256
    max_schema_bytes: int = 64 << 10  # response_format / tools / text.format, serialized
    max_waiting: int = 64  # requests queued beyond the slots before 429
    request_timeout: float | None = 600.0  # seconds; a request running longer is stopped (finish: length)


@dataclasses.dataclass
class Context:
    """What every conversion needs: the served names, the tokenizer, the engine's limits."""

    names: tuple[str, ...]
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]
    capacity: int
    max_logprobs: int
    limits: Limits
    version: str = "v4"
    default_thinking: bool = True
    compiler: Any = None  # dsjax.engine.constraints.ConstraintCompiler; None: structured output refused
    max_thinking_tokens: int | None = None  # structured output in thinking mode: reasoning closed after N tokens

    def __post_init__(self):
        options = recipe.ConversionOptions(default_thinking_mode=self.default_thinking)
        version = MODEL_VERSIONS[self.version]
        self.conversion = options.with_model_versions_by_name({name: version for name in self.names})
        encoding = recipe.DeepseekV4Encoding() if self.version == "v4" else recipe.DeepseekV41Encoding()
        self.encoding = encoding.with_tokenizer(self.tokenizer.recipe)
        self.created = int(time.time())

    @property
    def max_prompt_tokens(self) -> int:
        return self.limits.max_prompt_tokens or self.capacity - 1


@dataclasses.dataclass
class Choice:
    prompt: list[int]
    params: SamplingParams
    translator: Any
    constraint: tuple | None = None  # the OutputConstraint: (kind, schema, thinking, parallel tool calls,
    #                                   reasoning budget in thinking mode)


@dataclasses.dataclass
class Job:
    api: "API"
    stream: bool
    choices: list[Choice]
    response: Callable[[], dict | str]  # the non-streaming body, after every translator finished
    done_data: str | None = None  # the stream's last SSE data ("[DONE]" for Chat Completions)
    usage_chunk: Callable[[], tuple] | None = None  # Completions with stream_options.include_usage


# --------------------------------------------------------------------------- checks
def field_error(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def check_limits(body: dict, api: "API", ctx: Context) -> None:
    """Caps that hold before any conversion: stop strings, schema sizes, the model name."""
    model = body.get("model")
    if not isinstance(model, str):
        raise field_error("model", f"a model name is required (this server serves {', '.join(ctx.names)})")
    if model not in ctx.names:
        raise APIError(404, f"model {model!r} is not served here; GET /v1/models lists {', '.join(ctx.names)}",
                       kind="not_found_error" if api.anthropic else "invalid_request_error", param="model",
                       code="model_not_found")
    stop_key = "stop_sequences" if api.anthropic else "stop"
    stop = body.get(stop_key)
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(stops) > ctx.limits.max_stop:
        raise field_error(stop_key, f"at most {ctx.limits.max_stop} stop sequences, got {len(stops)}")
    if any(isinstance(s, str) and len(s) > ctx.limits.max_stop_chars for s in stops):
        raise field_error(stop_key, f"a stop sequence is longer than {ctx.limits.max_stop_chars} characters")
    for key in ("response_format", "tools", "text"):
        if key in body and len(json.dumps(body[key])) > ctx.limits.max_schema_bytes:
            raise field_error(key, f"larger than {ctx.limits.max_schema_bytes} bytes serialized")


def samples(body: dict, ctx: Context) -> int:
    """`n`, the samples per prompt (each a choice of its own: the same prompt, its own seed)."""
    n = number_field(body, "n", 1, int)
    if not 1 <= n <= ctx.limits.max_samples:
        raise field_error("n", f"an integer in [1, {ctx.limits.max_samples}] (samples per prompt), got {n}")
    return n


def sample_seed(seed: int | None, k: int) -> int | None:
    """The seed of a request's k-th choice: the request's seed + k (None: each a random one),
    so a choice is reproduced by a single request with that seed."""
    return None if seed is None else seed + k


def check_prompt_length(n: int, ctx: Context) -> None:
    if n > ctx.max_prompt_tokens:
        raise APIError(400, f"the prompt has {n} tokens; this server takes at most {ctx.max_prompt_tokens} "
                            f"(its context holds {ctx.capacity})", code="context_length_exceeded")


def _seed(value) -> int:
    """The engine's uint32 seed of an API seed in [0, 2**63) (the same seed, the same tokens);
    no seed: a fresh random one."""
    return secrets.randbits(32) if value is None else int(value) % 2**32


def check_logprobs(n: int, ctx: Context, param: str) -> int:
    if n > ctx.max_logprobs:
        raise field_error(param, f"this server returns at most {ctx.max_logprobs} logprobs per token "
                                  f"(start it with --max-logprobs N)" if ctx.max_logprobs else
                                  "this server was started without logprobs (dsjax serve --max-logprobs N)")
    return n


def request_temperature(body: dict, opts):
    """The recipe's temperature (1.0 in thinking mode, whatever was asked), but temperature 0
    is greedy in any mode: an evaluation that asks for reproducible answers gets them."""
    asked = body.get("temperature")
    return 0.0 if is_real(asked) and asked == 0 else opts.temperature


def _penalty(body: dict, key: str, default: float = 0.0) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise field_error(key, f"must be a number, got {type(value).__name__}")
    return float(value)


def logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's `logit_bias` ({"token id": bias in [-100, 100]}) as {id: bias}, each key and
    value checked by name (ids past the vocabulary: the engine's admission check)."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise field_error("logit_bias", f"an object mapping token ids to biases, got {type(value).__name__}")
    if len(value) > MAX_LOGIT_BIAS:
        raise field_error("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) < 10):
            raise field_error("logit_bias", f"key {key!r} is not a token id (a non-negative integer, as a string)")
        if not (is_real(bias) and -100 <= bias <= 100):
            raise field_error("logit_bias", f"the bias of token {key} must be a number in [-100, 100], "
                                            f"got {json.dumps(bias)}")
        out[int(key)] = float(bias)
    return out


def sampling(ctx: Context, *, temperature, top_p, max_tokens: int, seed, logprobs: int = 0, body: dict,
             prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's settings of one choice: what the API's own parsing resolved (temperature,
    top_p, max_tokens, seed, logprobs) and the fields read from the body here (penalties,
    logit_bias; vLLM's top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, which
    `field_table` refuses where an API has no such field)."""
    top_k = number_field(body, "top_k", 0, int)
    stop_ids = body.get("stop_token_ids") or ()
    if not (isinstance(stop_ids, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                        for t in stop_ids)):
        raise field_error("stop_token_ids", "a list of token ids")
    ignore_eos = body.get("ignore_eos") or False
    if not isinstance(ignore_eos, bool):
        raise field_error("ignore_eos", "must be a boolean")
    try:
        return SamplingParams(temperature=1.0 if temperature is None else float(temperature),
                              top_p=1.0 if top_p is None else float(top_p), max_tokens=int(max_tokens),
                              seed=_seed(seed), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              presence_penalty=_penalty(body, "presence_penalty"),
                              frequency_penalty=_penalty(body, "frequency_penalty"),
                              top_k=0 if top_k == -1 else top_k,  # vLLM's -1: off
                              min_p=_penalty(body, "min_p"),
                              repetition_penalty=_penalty(body, "repetition_penalty", 1.0),
                              stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos,
                              logit_bias=logit_bias(body))
    except ValueError as e:
        raise APIError(400, str(e).removeprefix("SamplingParams: ")) from None


@dataclasses.dataclass(frozen=True)
class API:
    name: str  # the metrics label
    path: str
    request_cls: Any = None
    response_cls: Any = None
    anthropic: bool = False


CHAT = API("chat", "/v1/chat/completions", recipe.ChatCompletionRequest, recipe.ChatCompletionResponse)


RESPONSES = API("responses", "/v1/responses", recipe.ResponsesRequest, recipe.ResponsesResponse)


MESSAGES = API("messages", "/v1/messages", recipe.MessagesRequest, recipe.MessagesResponse, anthropic=True)


COMPLETIONS = API("completions", "/v1/completions")


def new_id(api: API) -> str:
    prefix = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_", "completions": "cmpl-"}[api.name]
    return prefix + secrets.token_hex(12)


IMAGE_PARTS = ("image_url", "input_image", "image")


def check_no_images(body: dict) -> None:
    """Image parts are refused by name (the recipe would put "[Unsupported Image]" in their
    place for a text-only model; nothing is ever fetched)."""
    for key in ("messages", "input"):
        items = body.get(key)
        for i, item in enumerate(items if isinstance(items, list) else []):
            content = item.get("content") if isinstance(item, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                    raise APIError(400, f"{key}[{i}].content[{j}]: image inputs are not supported (this server runs "
                                        f"a text-only model)", param=f"{key}[{i}].content[{j}]")


def wide_integer(value, path: str = "") -> str | None:
    """The path of the first integer in a JSON body that no 64-bit field holds."""
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**64:
        return path or "body"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = wide_integer(item, f"{path}.{key}" if isinstance(key, str) and path else
                              key if isinstance(key, str) else f"{path}[{key}]")
        if found:
            return found
    return None


# fields a client may send that would change the answer but that this server does not do:
# refused by name rather than ignored
def number_field(body: dict, key: str, default, kind=float):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise field_error(key, f"must be {'an integer' if kind is int else 'a number'}, got {json.dumps(value)}")
    return value
