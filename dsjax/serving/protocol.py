"""API requests -> engine requests -> API events. deepseek-recipe owns every conversion of
the Chat Completions, Responses and Anthropic Messages APIs: request -> conversation ->
prompt ids (its V4 encoding), and generated ids -> events (reasoning, DSML tool calls, JSON
output, stop sequences, finish reasons, usage). Nothing here renders a chat template or
parses model output; the legacy Completions API (a raw prompt, no conversation) is the one
shape written here, over `dsjax.generate.TextRun` (stop strings, logprobs).

    job = prepare(CHAT, body, ctx)                 # APIError(status, message) on bad input
    job.choices[i]: prompt ids, SamplingParams, output constraint, a Translator
    translator.start() / .push(events) / .finish(reason) -> [(sse event name | None, json str)]
    translator.stopped: a stop sequence ended the answer (cancel the engine request)
    job.response([...translators]) -> the non-streaming JSON body
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from typing import Any, Callable

import deepseek_recipe as recipe

from dsjax.engine import SamplingParams, TokenEvent
from dsjax.engine.sampler import is_real
from dsjax.generate import TextRun
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
def _field_error(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def check_limits(body: dict, api: "API", ctx: Context) -> None:
    """Caps that hold before any conversion: stop strings, schema sizes, the model name."""
    model = body.get("model")
    if not isinstance(model, str):
        raise _field_error("model", f"a model name is required (this server serves {', '.join(ctx.names)})")
    if model not in ctx.names:
        raise APIError(404, f"model {model!r} is not served here; GET /v1/models lists {', '.join(ctx.names)}",
                       kind="not_found_error" if api.anthropic else "invalid_request_error", param="model",
                       code="model_not_found")
    stop_key = "stop_sequences" if api.anthropic else "stop"
    stop = body.get(stop_key)
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(stops) > ctx.limits.max_stop:
        raise _field_error(stop_key, f"at most {ctx.limits.max_stop} stop sequences, got {len(stops)}")
    if any(isinstance(s, str) and len(s) > ctx.limits.max_stop_chars for s in stops):
        raise _field_error(stop_key, f"a stop sequence is longer than {ctx.limits.max_stop_chars} characters")
    for key in ("response_format", "tools", "text"):
        if key in body and len(json.dumps(body[key])) > ctx.limits.max_schema_bytes:
            raise _field_error(key, f"larger than {ctx.limits.max_schema_bytes} bytes serialized")


def check_prompt_length(n: int, ctx: Context) -> None:
    if n > ctx.max_prompt_tokens:
        raise APIError(400, f"the prompt has {n} tokens; this server takes at most {ctx.max_prompt_tokens} "
                            f"(its context holds {ctx.capacity})", code="context_length_exceeded")


def _seed(value) -> int:
    """The engine's uint32 seed of an API seed in [0, 2**63) (the same seed, the same tokens);
    no seed: a fresh random one."""
    return secrets.randbits(32) if value is None else int(value) % 2**32


def _logprobs(n: int, ctx: Context, param: str) -> int:
    if n > ctx.max_logprobs:
        raise _field_error(param, f"this server returns at most {ctx.max_logprobs} logprobs per token "
                                  f"(start it with --max-logprobs N)" if ctx.max_logprobs else
                                  "this server was started without logprobs (dsjax serve --max-logprobs N)")
    return n


def _temperature(body: dict, opts):
    """The recipe's temperature (1.0 in thinking mode, whatever was asked), but temperature 0
    is greedy in any mode: an evaluation that asks for reproducible answers gets them."""
    asked = body.get("temperature")
    return 0.0 if is_real(asked) and asked == 0 else opts.temperature


def _penalty(body: dict, key: str) -> float:
    value = body.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _field_error(key, f"must be a number, got {type(value).__name__}")
    return float(value)


def sampling(ctx: Context, *, temperature, top_p, max_tokens: int, seed, logprobs: int = 0, body: dict,
             prompt_logprobs: int | None = None) -> SamplingParams:
    try:
        return SamplingParams(temperature=1.0 if temperature is None else float(temperature),
                              top_p=1.0 if top_p is None else float(top_p), max_tokens=int(max_tokens),
                              seed=_seed(seed), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              presence_penalty=_penalty(body, "presence_penalty"),
                              frequency_penalty=_penalty(body, "frequency_penalty"))
    except ValueError as e:
        raise APIError(400, str(e).removeprefix("SamplingParams: ")) from None


# --------------------------------------------------------------------------- recipe APIs
class RecipeTranslator:
    """Engine TokenEvents -> one API's events, by deepseek-recipe's StreamProcessor. The EOS
    that ends a turn is not text: it goes in as an empty text chunk counting one token, so
    usage counts every token the engine generated."""

    def __init__(self, api: "API", generator, conv, ctx: Context, prompt_tokens: int):
        self.api, self.ctx, self.prompt_tokens = api, ctx, prompt_tokens
        self.processor = recipe.StreamProcessor(generator, conv.parsing_options, ctx.tokenizer.recipe)
        self.want_logprobs = bool(conv.inference_options.logprobs)
        self.events: list = []  # kept for the non-streaming accumulation
        self.keep = False
        self.tokens = 0

    @property
    def stopped(self) -> bool:
        """A stop sequence (or the parser) ended the answer: nothing more is taken."""
        return self.processor.finished

    def _out(self, events) -> list[tuple[str | None, str]]:
        if self.keep:
            self.events.extend(events)
            return []
        return [(self.api.response_cls.sse_event_name(e), e.to_json()) for e in events]

    def start(self, cached_tokens: int = 0):
        """The API's opening events; cached_tokens: prompt tokens the prefix cache held (known
        once the request was admitted, from its first event)."""
        usage = recipe.PromptUsage(prompt_tokens=self.prompt_tokens, prompt_cache_hit_tokens=cached_tokens)
        return self._out(self.processor.push(recipe.InferenceChunk.ready(prompt_usage=usage)))

    def push(self, events: list[TokenEvent]):
        out = []
        for event in events:
            if self.stopped:
                break
            self.tokens += 1
            if event.finish_reason == "stop" and event.token in self.ctx.eos_ids:
                chunk = recipe.InferenceChunk.text("", 1)
            elif self.want_logprobs:
                top = [(t, v) for t, v in (event.top_logprobs or [])]
                chunk = recipe.InferenceChunk.tokens([event.token], [(event.logprob or 0.0, top)])
            else:
                chunk = recipe.InferenceChunk.tokens([event.token])
            out += self.processor.push(chunk)
        return self._out(out)

    def finish(self, reason: str | None):
        out = []
        if not self.stopped:
            kind = recipe.InferenceFinishReason.Stop if reason == "stop" else recipe.InferenceFinishReason.Length
            out += self.processor.push(recipe.InferenceChunk.finish(kind))
        out += self.processor.finish()
        return self._out(out)

    def close(self) -> None:
        if not self.processor.finished:
            self.processor.close()


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


def _new_id(api: API) -> str:
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


def _culprit(api: API, body: dict, error: str) -> str:
    """The recipe's body errors are serde messages without a path ("invalid type: string
    "hot", expected f32"): name the top-level field whose removal makes the body parse."""
    for key in body:
        if key != "model":
            try:
                api.request_cls({k: v for k, v in body.items() if k != key})
            except ValueError as without:  # a required field: removing it is "missing field `key`"
                if f"missing field `{key}`" not in str(without):
                    continue
            return f"{key}: {error.removeprefix('invalid request body: ')}"
    return error


def _wide_integer(value, path: str = "") -> str | None:
    """The path of the first integer in a JSON body that no 64-bit field holds."""
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**64:
        return path or "body"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _wide_integer(item, f"{path}.{key}" if isinstance(key, str) and path else
                              key if isinstance(key, str) else f"{path}[{key}]")
        if found:
            return found
    return None


def thinking_budget(body: dict, ctx: Context, max_tokens: int) -> int:
    """The reasoning tokens a constrained answer (structured output, tools) in thinking mode
    may spend before `</think>` is forced, so that the answer always gets tokens: the
    request's `thinking.budget_tokens`, else `--max-thinking-tokens`, else half of max_tokens."""
    thinking = body.get("thinking")
    given = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    if given is None:
        return ctx.max_thinking_tokens if ctx.max_thinking_tokens is not None else max_tokens // 2
    if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given < max_tokens:
        raise _field_error("thinking.budget_tokens", f"an integer in [0, max_tokens = {max_tokens}), got {given!r}")
    return given


def _callers_tools(api: API, body: dict) -> dict:
    """Tool name -> parameters schema, as the body wrote them (Chat: tools[].function;
    Responses: flat function tools; Messages: input_schema)."""
    out = {}
    for tool in body.get("tools") or []:
        fn = tool.get("function", tool) if api is CHAT and isinstance(tool, dict) else tool
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("input_schema" if api is MESSAGES else "parameters")
            if isinstance(params, dict):
                out[fn["name"]] = params
    return out


def callers_constraint(api: API, body: dict, kind: str, schema: str) -> tuple[str, str]:
    """The output constraint as the caller asked for it. The recipe names the kind and the
    tools, but its strict-mode schemas leave keywords out (maxLength, minLength, ...), it
    reads `json_object` as any JSON value and Anthropic's tool_choice "any" as "auto". The
    grammar is compiled from the body's own schemas, so a keyword the grammar library
    cannot enforce is refused by name (400) rather than dropped."""
    if kind == "json":
        fmt = body.get("response_format") if api is CHAT else (body.get("text") or {}).get("format") \
            if api is RESPONSES and isinstance(body.get("text"), dict) else None
        if not schema:  # json_object: a JSON object, as OpenAI defines it
            return kind, json.dumps({"type": "object"})
        if isinstance(fmt, dict):
            own = (fmt.get("json_schema") or {}).get("schema") if api is CHAT else fmt.get("schema")
            if isinstance(own, (dict, bool)):
                return kind, json.dumps(own)
        return kind, schema
    if kind.startswith("tool_call"):
        own, tools = _callers_tools(api, body), json.loads(schema)
        for tool in tools:
            fn = tool.get("function", tool)
            if fn.get("name") in own:
                fn["parameters"] = own[fn["name"]]
        choice = body.get("tool_choice")
        if api is MESSAGES and kind == "tool_call" and isinstance(choice, dict) and choice.get("type") == "any":
            kind = "tool_call_any"
        return kind, json.dumps(tools)
    return kind, schema


def _parallel_tool_calls(api: API, body: dict) -> bool:
    """Whether one answer may call several tools: OpenAI `parallel_tool_calls` (default
    true), Anthropic `tool_choice.disable_parallel_tool_use`."""
    if api.anthropic:
        choice = body.get("tool_choice")
        return not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)
    return body.get("parallel_tool_calls") is not False


def _recipe_body(api: API, body: dict) -> dict:
    """Fields the recipe does not read, mapped onto those it does or refused by name:
    Chat's `max_completion_tokens` (the name OpenAI's clients send) is `max_tokens`;
    Anthropic's required `max_tokens` is required."""
    if api is CHAT and "max_completion_tokens" in body:
        value = body["max_completion_tokens"]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise _field_error("max_completion_tokens", f"an integer >= 1, got {value!r}")
        if body.get("max_tokens") is not None and value is not None and body["max_tokens"] != value:
            raise _field_error("max_completion_tokens", f"{value} differs from max_tokens {body['max_tokens']!r} "
                                                        f"(send one of them)")
        body = {k: v for k, v in body.items() if k != "max_completion_tokens"}
        if value is not None:
            body["max_tokens"] = value
    if api is MESSAGES and body.get("max_tokens") is None:
        raise _field_error("max_tokens", "required: the most tokens to generate (an integer >= 1)")
    check_unsupported(api, body)
    return body


# fields a client may send that would change the answer but that this server does not do:
# refused by name rather than ignored
UNSUPPORTED = {"logit_bias": "logit_bias is not supported yet",
               "previous_response_id": "this server stores no responses (send the conversation in `input`)"}


def check_unsupported(api: API, body: dict) -> None:
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, {}, "") and (key != "previous_response_id" or api is RESPONSES):
            raise _field_error(key, why)


def convert(api: API, body: dict, ctx: Context):
    """A body's model name, Responses extras (echo, tool namespaces), the recipe's conversion
    and the prompt ids (APIError on bad input)."""
    check_limits(body, api, ctx)
    check_no_images(body)
    try:
        req = api.request_cls(body)
    except ValueError as e:
        raise APIError(400, _culprit(api, body, str(e))) from None
    except OverflowError:  # the recipe reads JSON integers as 64-bit
        where = _wide_integer(body)
        raise APIError(400, f"{where or 'a number'}: an integer out of the 64-bit range", param=where) from None
    try:
        model = req.model
        extra = (req.echo(), req.namespace_tool_map(ctx.conversion)) if api is RESPONSES else None
        conv = req.convert(ctx.conversion)  # consumes req
    except (ValueError, recipe.ConversionError) as e:  # the recipe's messages name the field
        raise APIError(400, str(e)) from None
    prompt = ctx.encoding.encode(conv.conversation)
    check_prompt_length(len(prompt), ctx)
    return model, extra, conv, prompt


def count_tokens(body: Any, ctx: Context) -> int:
    """Anthropic's /v1/messages/count_tokens: the prompt ids a Messages body would send."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return len(convert(MESSAGES, {**body, "max_tokens": 1}, ctx)[3])


def prepare_recipe(api: API, body: dict, ctx: Context) -> Job:
    body = _recipe_body(api, body)
    model, extra, conv, prompt = convert(api, body, ctx)
    conversation = conv.conversation
    opts = conv.inference_options
    try:
        max_tokens = conv.resolve_max_tokens(len(prompt), ctx.capacity)
    except recipe.ConversionError as e:
        raise APIError(400, str(e), code="context_length_exceeded") from None
    if ctx.limits.max_tokens is not None:
        max_tokens = min(max_tokens, ctx.limits.max_tokens)
    n_logprobs = _logprobs(max(opts.top_logprobs or 0, int(opts.logprobs)), ctx, "top_logprobs")
    params = sampling(ctx, temperature=_temperature(body, opts), top_p=opts.top_p, max_tokens=max_tokens,
                      seed=opts.seed, logprobs=n_logprobs, body=body)
    constraint = opts.output_constraint
    budget = thinking_budget(body, ctx, max_tokens)
    spec = None if constraint is None else (*callers_constraint(api, body, constraint.kind, constraint.schema),
                                            conversation.thinking_mode, _parallel_tool_calls(api, body),
                                            budget if conversation.thinking_mode else None)
    response_id, created = _new_id(api), int(time.time())
    if api is MESSAGES:
        generator = recipe.MessagesChunkGenerator(response_id, model, conversation.thinking_mode)
    else:
        generator = api.request_cls.chunk_generator(conv, response_id, model)
    if extra is not None:
        generator = generator.with_echo(extra[0]).with_namespace_tool_map(extra[1])
    translator = RecipeTranslator(api, generator, conv, ctx, len(prompt))
    translator.keep = not conv.stream

    def response():
        acc = api.response_cls(response_id, model, created, len(prompt), 0)
        for event in translator.events:
            acc.accumulate(event)
        return acc.to_json()

    return Job(api, conv.stream, [Choice(prompt, params, translator, spec)], response,
               api.response_cls.sse_done_data())


# --------------------------------------------------------------------------- /v1/completions
class CompletionTranslator:
    """One prompt of a Completions request: text deltas (stop strings cut on the decoded
    text), OpenAI `logprobs` ({tokens, token_logprobs, top_logprobs, text_offset}).
    echo (the prompt's text, and with logprobs its tokens' logprobs, before the generated
    ones: null for the first token, which nothing predicts) and vLLM's `prompt_logprobs`
    (per prompt token, null then {id: {logprob, rank, decoded_token}}: the token's own and
    the top n) come with the first event, which carries the prompt's scores."""

    def __init__(self, index: int, ctx: Context, stop: tuple[str, ...], logprobs: int | None, head: dict, *,
                 prompt: list[int] | None = None, echo: str | None = None, prompt_logprobs: int | None = None):
        self.index, self.ctx, self.head = index, ctx, head
        self.run = TextRun(ctx.tokenizer, stop, logprobs is not None)
        self.finish_reason: str | None = None
        self.keep = False
        self.cached_tokens = 0
        self.prompt, self.echo, self.n_prompt_logprobs = prompt, echo, prompt_logprobs
        self.top_n = max(logprobs or 0, 1)  # as for generated tokens: logprobs 0 still shows the top one
        self.echo_entries: list[dict] = []  # the prompt's logprobs entries (echo with logprobs)
        self.prompt_logprobs: list | None = None  # vLLM's shape
        self.echoed = False

    def _take_prompt(self, event: TokenEvent) -> None:
        scores = event.prompt_logprobs or [None] * len(self.prompt)
        if self.echo is not None and self.run.logprobs is not None:
            for token, entry in zip(self.prompt, scores):
                top = None if entry is None else [{"token": t, "logprob": v} for t, v in (entry[1] or [])[: self.top_n]]
                self.echo_entries.append({"token": token, "logprob": None if entry is None else entry[0],
                                          "top_logprobs": top})
        if self.n_prompt_logprobs is not None:
            decode = lambda t: self.ctx.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
            self.prompt_logprobs = [None]
            for token, entry in zip(self.prompt[1:], scores[1:]):
                ranked = {str(token): {"logprob": entry[0], "rank": entry[2], "decoded_token": decode(token)}}
                for r, (t, v) in enumerate((entry[1] or [])[: self.n_prompt_logprobs], 1):
                    ranked.setdefault(str(t), {"logprob": v, "rank": r, "decoded_token": decode(t)})
                self.prompt_logprobs.append(ranked)

    @property
    def stopped(self) -> bool:
        return self.run.finish_reason is not None

    @property
    def tokens(self) -> int:
        return len(self.run.ids)

    def _chunk(self, text: str, logprobs, finish_reason, prompt_logprobs=None):
        choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        return [] if self.keep else [(None, json.dumps({**self.head, "choices": [choice]}))]

    def _logprobs(self, entries: list[dict], offset: int):
        if self.run.logprobs is None:
            return None
        tok = self.ctx.tokenizer
        texts = [tok.decode([e["token"]], skip_special_tokens=False) for e in entries]
        offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [None if e["top_logprobs"] is None else
                                 {tok.decode([t["token"]], skip_special_tokens=False): t["logprob"]
                                  for t in e["top_logprobs"]} for e in entries], "text_offset": offsets}

    def start(self, cached_tokens: int = 0):
        self.cached_tokens = cached_tokens  # for usage.prompt_tokens_details
        return []

    def push(self, events: list[TokenEvent]):
        if self.stopped:
            return []
        head, entries, prompt_logprobs = "", [], None
        if not self.echoed and events:  # the first event: the prompt's part
            self.echoed = True
            self._take_prompt(events[0])
            head, entries, prompt_logprobs = self.echo or "", self.echo_entries, self.prompt_logprobs
        first, offset, text = len(self.run.ids), self.run.emitted, ""
        for event in events:
            text += self.run.take(event)
            if self.stopped:
                break
        if not text and not head and self.run.logprobs is None and prompt_logprobs is None:
            return []
        offset += len(self.echo or "") if not head else 0
        return self._chunk(head + text, self._logprobs(entries + self.run.logprobs[first:], offset)
                           if self.run.logprobs is not None else None, None, prompt_logprobs)

    def finish(self, reason: str | None):
        self.finish_reason = self.run.finish_reason or ("stop" if reason == "stop" else "length")
        return self._chunk("", None, self.finish_reason)

    def close(self) -> None:
        pass

    def choice(self) -> dict:
        lp = self.run.logprobs
        out = {"index": self.index, "text": (self.echo or "") + self.run.text, "finish_reason": self.finish_reason,
               "logprobs": self._logprobs(self.echo_entries + lp, 0) if lp is not None else None}
        if self.n_prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs
        return out


def _prompts(body: dict, ctx: Context) -> list[list[int]]:
    prompt = body.get("prompt")
    bos = [ctx.tokenizer.bos_id] if ctx.tokenizer.bos_id is not None else []
    if isinstance(prompt, str):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise _field_error("prompt", "a string, a list of strings, a list of token ids or a list of such lists")
    if len(items) > ctx.limits.max_prompts:
        raise _field_error("prompt", f"at most {ctx.limits.max_prompts} prompts per request, got {len(items)}")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(bos + ctx.tokenizer.encode(item))
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            out.append(list(item))
        else:
            raise _field_error(f"prompt[{i}]", "each prompt must be a string or a non-empty list of token ids")
    return out


def _number(body: dict, key: str, default, kind=float):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise _field_error(key, f"must be {'an integer' if kind is int else 'a number'}, got {json.dumps(value)}")
    return value


def prepare_completions(body: dict, ctx: Context) -> Job:
    api = COMPLETIONS
    check_limits(body, api, ctx)
    prompts = _prompts(body, ctx)
    for p in prompts:
        check_prompt_length(len(p), ctx)
    if _number(body, "n", 1, int) != 1 or _number(body, "best_of", 1, int) != 1:
        raise _field_error("n", "only n = 1 (and best_of = 1) is supported")
    echo = body.get("echo", False)
    if not isinstance(echo, bool) and echo is not None:
        raise _field_error("echo", "must be a boolean")
    prompt_logprobs = body.get("prompt_logprobs")  # vLLM's: each prompt token's logprob and the top n
    if prompt_logprobs is not None:
        if isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, int) or prompt_logprobs < 0:
            raise _field_error("prompt_logprobs", "an integer >= 0 (top logprobs per prompt token)")
        _logprobs(prompt_logprobs, ctx, "prompt_logprobs")
    if body.get("suffix"):
        raise _field_error("suffix", "suffix (fill in the middle) is not supported")
    check_unsupported(COMPLETIONS, body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _field_error("stream", "must be a boolean")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else ()
    if stop is not None and not (stops and all(isinstance(s, str) and s for s in stops)):
        raise _field_error("stop", "a non-empty string or a list of them")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise _field_error("logprobs", "an integer >= 0 (top logprobs per token)")
    if logprobs is not None:
        _logprobs(max(logprobs, 1), ctx, "logprobs")
    max_tokens = _number(body, "max_tokens", 16, int)
    if max_tokens < 0 or (max_tokens == 0 and not echo and prompt_logprobs is None):
        raise _field_error("max_tokens", "must be >= 1 (0 only with echo or prompt_logprobs: the prompt alone)")
    # the prompt is scored when its logprobs are shown: echo with logprobs, prompt_logprobs, or max_tokens 0
    scored = [n for n in (logprobs if echo else None, prompt_logprobs) if n is not None]
    n_scored = max(max(scored), 1) if scored else 0 if max_tokens == 0 else None
    cap = ctx.limits.max_tokens or ctx.capacity
    longest = max(len(p) for p in prompts)
    if max_tokens > cap or longest + max_tokens > ctx.capacity:
        raise APIError(400, f"max_tokens {max_tokens} + the prompt's {longest} tokens exceed this server's "
                            f"context of {ctx.capacity} tokens" if max_tokens <= cap else
                       f"max_tokens: at most {cap}", param="max_tokens", code="context_length_exceeded")
    seed = _number(body, "seed", None, int)
    if seed is not None and seed < 0:
        raise _field_error("seed", "must be >= 0")
    response_id, created, model = _new_id(api), int(time.time()), body["model"]
    head = {"id": response_id, "object": "text_completion", "created": created, "model": model}
    choices = []
    for i, p in enumerate(prompts):
        params = sampling(ctx, temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
                          max_tokens=max_tokens, seed=None if seed is None else seed + i,
                          logprobs=0 if logprobs is None else max(logprobs, 1), body=body,
                          prompt_logprobs=None if n_scored is None else min(n_scored, ctx.max_logprobs))
        text = body["prompt"] if isinstance(body["prompt"], str) else body["prompt"][i]
        shown = (text if isinstance(text, str) else ctx.tokenizer.decode(p)) if echo else None  # echo: the prompt's text
        translator = CompletionTranslator(i, ctx, stops, logprobs, head, prompt=p, prompt_logprobs=prompt_logprobs,
                                          echo=shown)
        translator.keep = not stream
        choices.append(Choice(p, params, translator))
    usage = lambda: {"prompt_tokens": sum(len(p) for p in prompts),  # noqa: E731
                     "completion_tokens": sum(c.translator.tokens for c in choices),
                     "total_tokens": sum(len(p) for p in prompts) + sum(c.translator.tokens for c in choices),
                     "prompt_tokens_details": {"cached_tokens": sum(c.translator.cached_tokens for c in choices)}}

    def response():
        return {**head, "choices": [c.translator.choice() for c in choices], "usage": usage()}

    include_usage = stream and bool((body.get("stream_options") or {}).get("include_usage"))
    usage_chunk = (lambda: (None, json.dumps({**head, "choices": [], "usage": usage()}))) if include_usage else None
    return Job(api, stream, choices, response, "[DONE]", usage_chunk)


def prepare(api: API, body: Any, ctx: Context) -> Job:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    if api is not COMPLETIONS and body.get("prompt_logprobs") is not None:  # never accepted and ignored
        raise _field_error("prompt_logprobs", f"prompt_logprobs is served on /v1/completions only, not {api.path}")
    return prepare_completions(body, ctx) if api is COMPLETIONS else prepare_recipe(api, body, ctx)


# --------------------------------------------------------------------------- /tokenize, /detokenize, /tokenizer_info
def _ids_field(value, param: str, ctx: Context) -> list[int]:
    if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise _field_error(param, "a list of token ids")
    bad = [t for t in value if not 0 <= t < ctx.tokenizer.vocab_size]
    if bad:
        raise _field_error(param, f"token id {bad[0]} is outside the vocabulary [0, {ctx.tokenizer.vocab_size})")
    return value


def tokenize(body: Any, ctx: Context) -> dict:
    """vLLM's /tokenize: {prompt, add_special_tokens (default true: BOS first, as a
    Completions text prompt gets), return_token_strs} or {messages, ...} (the prompt a Chat
    Completions request of them would have) -> {count, max_model_len, tokens, token_strs}."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    special, strs = body.get("add_special_tokens", True), body.get("return_token_strs", False)
    for key, value in (("add_special_tokens", special), ("return_token_strs", strs)):
        if not isinstance(value, bool):
            raise _field_error(key, "must be a boolean")
    if "messages" in body:
        chat = {k: v for k, v in body.items() if k not in ("add_special_tokens", "return_token_strs",
                                                             "add_generation_prompt")}
        ids = prepare_recipe(CHAT, {"model": ctx.names[0], **chat}, ctx).choices[0].prompt
    elif isinstance(body.get("prompt"), str):
        bos = [ctx.tokenizer.bos_id] if special and ctx.tokenizer.bos_id is not None else []
        ids = bos + ctx.tokenizer.encode(body["prompt"])
    else:
        raise _field_error("prompt", "a string (or messages, a chat to encode)")
    token_strs = [ctx.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if strs else None
    return {"count": len(ids), "max_model_len": ctx.capacity, "tokens": ids, "token_strs": token_strs}


def detokenize(body: Any, ctx: Context) -> dict:
    """vLLM's /detokenize: {tokens} -> {prompt} (special tokens kept: the text of the ids)."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    ids = _ids_field(body.get("tokens"), "tokens", ctx)
    return {"prompt": ctx.tokenizer.decode(ids, skip_special_tokens=False)}


def tokenizer_info(ctx: Context) -> dict:
    """vLLM's /tokenizer_info: what a client needs to tokenize as the server does (lm-eval's
    remote tokenizer reads bos / eos / pad). No chat_template: the recipe encodes chats, and
    /tokenize with messages gives their ids."""
    tok = ctx.tokenizer
    name = lambda i: None if i is None else tok.decode([i], skip_special_tokens=False)  # noqa: E731
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(tok.bos_id), "eos_token": name(tok.eos_id),
            "pad_token": None, "model_max_length": ctx.capacity, "vocab_size": tok.vocab_size,
            "add_bos_token": True, "chat_template": None}
