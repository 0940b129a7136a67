"""Chat Completions, Responses and Anthropic Messages through deepseek-recipe: request ->
conversation -> prompt ids (its V4 / V4.1 encoding), generated ids -> the API's events
(reasoning, DSML tool calls, JSON output, stop sequences, finish reasons, usage). What the
recipe does not read is mapped or refused here (`max_completion_tokens`, the caller's own
schemas for structured output, the reasoning budget)."""

from __future__ import annotations

import json
import time
from typing import Any

import deepseek_recipe as recipe

from dsjax.engine import TokenEvent
from dsjax.protocol.fields import (API, CHAT, MESSAGES, RESPONSES, APIError, check_limits, check_logprobs,
                                   check_no_images, check_prompt_length, Choice, Context, field_error, Job, new_id,
                                   number_field, request_temperature, sample_seed, samples, sampling, wide_integer)


# --------------------------------------------------------------------------- recipe APIs
class RecipeTranslator:
    """Engine TokenEvents -> one API's events, by deepseek-recipe's StreamProcessor. The EOS
    that ends a turn is not text: it goes in as an empty text chunk counting one token, so
    usage counts every token the engine generated. So do the tokens an answer cut by
    max_tokens ends in while they spell part of a character: the recipe holds their bytes
    for the rest of it and at the end drops them uncounted; their text stays out (as
    vLLM's), their count goes in as an empty text chunk.

    index: choice k of a Chat Completions request with n > 1. The recipe writes every chunk as
    choice 0 with its own usage; then each streamed chunk gets its index and loses its usage
    (kept in `usage`), which the request reports once, summed (`merged_usage`)."""

    def __init__(self, api: "API", generator, conv, ctx: Context, prompt_tokens: int, index: int | None = None):
        self.api, self.ctx, self.prompt_tokens, self.index = api, ctx, prompt_tokens, index
        self.usage = None
        self.processor = recipe.StreamProcessor(generator, conv.parsing_options, ctx.tokenizer.recipe)
        self.want_logprobs = bool(conv.inference_options.logprobs)
        self.events: list = []  # kept for the non-streaming accumulation
        self.keep = False
        self.tokens = 0
        self._text = ctx.tokenizer.stream(skip_special_tokens=False)
        self._split = 0  # the last tokens, whose bytes end inside a character (the recipe holds them)

    @property
    def stopped(self) -> bool:
        """A stop sequence (or the parser) ended the answer: nothing more is taken."""
        return self.processor.finished

    def _out(self, events) -> list[tuple[str | None, str]]:
        if self.keep:
            self.events.extend(events)
            return []
        out = [(self.api.response_cls.sse_event_name(e), e.to_json()) for e in events]
        return out if self.index is None else [(name, self._indexed(data)) for name, data in out]

    def _indexed(self, data: str) -> str:
        chunk = json.loads(data)
        for c in chunk.get("choices") or []:
            c["index"] = self.index
        self.usage = chunk.pop("usage", None) or self.usage
        return json.dumps({**chunk, "usage": None})

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
            if chunk.kind == "tokens":
                self._split = 0 if self._text.push(event.token) else self._split + 1
            out += self.processor.push(chunk)
        return self._out(out)

    def finish(self, reason: str | None):
        out = []
        if not self.stopped:
            if self._split:
                out += self.processor.push(recipe.InferenceChunk.text("", self._split))
            kind = recipe.InferenceFinishReason.Stop if reason == "stop" else recipe.InferenceFinishReason.Length
            out += self.processor.push(recipe.InferenceChunk.finish(kind))
        out += self.processor.finish()
        return self._out(out)

    def close(self) -> None:
        if not self.processor.finished:
            self.processor.close()


def merged_usage(usages: list[dict]) -> dict:
    """One request's usage from its choices': the prompt's counts once, the generated summed."""
    out = dict(usages[0])
    out["completion_tokens"] = sum(u.get("completion_tokens") or 0 for u in usages)
    out["total_tokens"] = out["completion_tokens"] + (out.get("prompt_tokens") or 0)
    details = [u.get("completion_tokens_details") for u in usages]
    if all(isinstance(d, dict) for d in details):
        out["completion_tokens_details"] = {k: sum(d.get(k) or 0 for d in details) for k in details[0]}
    return out


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


def thinking_budget(body: dict, ctx: Context, max_tokens: int) -> int:
    """The reasoning tokens a constrained answer (structured output, tools) in thinking mode
    may spend before `</think>` is forced, so that the answer always gets tokens: the
    request's `thinking.budget_tokens`, else `--max-thinking-tokens`, else half of max_tokens."""
    thinking = body.get("thinking")
    given = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    if given is None:
        return ctx.max_thinking_tokens if ctx.max_thinking_tokens is not None else max_tokens // 2
    if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given < max_tokens:
        raise field_error("thinking.budget_tokens", f"an integer in [0, max_tokens = {max_tokens}), got {given!r}")
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
            raise field_error("max_completion_tokens", f"an integer >= 1, got {value!r}")
        if body.get("max_tokens") is not None and value is not None and body["max_tokens"] != value:
            raise field_error("max_completion_tokens", f"{value} differs from max_tokens {body['max_tokens']!r} "
                                                        f"(send one of them)")
        body = {k: v for k, v in body.items() if k != "max_completion_tokens"}
        if value is not None:
            body["max_tokens"] = value
    if api is MESSAGES and body.get("max_tokens") is None:
        raise field_error("max_tokens", "required: the most tokens to generate (an integer >= 1)")
    return body


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
        where = wide_integer(body)
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
    n = 1
    if api is CHAT:  # the recipe converts one sample: n is read (and removed) here
        n, body = samples(body, ctx), {k: v for k, v in body.items() if k != "n"}
    model, extra, conv, prompt = convert(api, body, ctx)
    conversation = conv.conversation
    opts = conv.inference_options
    try:
        max_tokens = conv.resolve_max_tokens(len(prompt), ctx.capacity)
    except recipe.ConversionError as e:
        raise APIError(400, str(e), code="context_length_exceeded") from None
    if ctx.limits.max_tokens is not None:
        max_tokens = min(max_tokens, ctx.limits.max_tokens)
    n_logprobs = check_logprobs(max(opts.top_logprobs or 0, int(opts.logprobs)), ctx, "top_logprobs")
    constraint = opts.output_constraint
    budget = thinking_budget(body, ctx, max_tokens)
    spec = None if constraint is None else (*callers_constraint(api, body, constraint.kind, constraint.schema),
                                            conversation.thinking_mode, _parallel_tool_calls(api, body),
                                            budget if conversation.thinking_mode else None)
    seed = opts.seed
    if api in (RESPONSES, MESSAGES):  # the recipe reads no seed there; dsjax's extension, as on Chat
        seed = number_field(body, "seed", None, int)
        if seed is not None and not 0 <= seed < 2**63:
            raise field_error("seed", f"an integer in [0, 2**63), got {seed}")
    response_id, created = new_id(api), int(time.time())
    choices = []
    for k in range(n):
        if api is MESSAGES:
            generator = recipe.MessagesChunkGenerator(response_id, model, conversation.thinking_mode)
        else:
            generator = api.request_cls.chunk_generator(conv, response_id, model)
        if extra is not None:
            generator = generator.with_echo(extra[0]).with_namespace_tool_map(extra[1])
        translator = RecipeTranslator(api, generator, conv, ctx, len(prompt), k if n > 1 else None)
        translator.keep = not conv.stream
        params = sampling(ctx, temperature=request_temperature(body, opts), top_p=opts.top_p, max_tokens=max_tokens,
                          seed=sample_seed(seed, k), logprobs=n_logprobs, body=body)
        choices.append(Choice(prompt, params, translator, spec))

    def one(translator) -> str:
        acc = api.response_cls(response_id, model, created, len(prompt), 0)
        for event in translator.events:
            acc.accumulate(event)
        return acc.to_json()

    def response():
        if n == 1:
            return one(choices[0].translator)
        bodies = [json.loads(one(c.translator)) for c in choices]
        merged = bodies[0]
        merged["choices"] = [{**c, "index": k} for k, b in enumerate(bodies) for c in b["choices"]]
        if all(b.get("usage") for b in bodies):
            merged["usage"] = merged_usage([b["usage"] for b in bodies])
        return merged

    def usage_chunk():  # n > 1: the usage the choices' chunks left out, summed, in a chunk of its own
        usages = [c.translator.usage for c in choices if c.translator.usage]
        return None, json.dumps({"id": response_id, "object": "chat.completion.chunk", "created": created,
                                 "model": model, "choices": [], "usage": merged_usage(usages) if usages else None})

    include_usage = n > 1 and conv.stream and (body.get("stream_options") or {}).get("include_usage")
    return Job(api, conv.stream, choices, response, api.response_cls.sse_done_data(),
               usage_chunk if include_usage else None)
