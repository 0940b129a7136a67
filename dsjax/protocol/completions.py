"""The legacy Completions API (a raw prompt, no conversation): the one shape written here,
over `dsjax.output.TextRun` (stop strings, logprobs), with `echo` and prompt logprobs."""

from __future__ import annotations

import json
import time


from dsjax.engine import TokenEvent
from dsjax.output import TextRun
from dsjax.protocol.fields import (COMPLETIONS, APIError, check_limits, check_logprobs, check_prompt_length,
                                  Choice, Context, field_error, Job, new_id, number_field,
                                  sample_seed, samples, sampling)


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
        raise field_error("prompt", "a string, a list of strings, a list of token ids or a list of such lists")
    if len(items) > ctx.limits.max_prompts:
        raise field_error("prompt", f"at most {ctx.limits.max_prompts} prompts per request, got {len(items)}")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(bos + ctx.tokenizer.encode(item))
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            out.append(list(item))
        else:
            raise field_error(f"prompt[{i}]", "each prompt must be a string or a non-empty list of token ids")
    return out


def prepare_completions(body: dict, ctx: Context) -> Job:
    api = COMPLETIONS
    check_limits(body, api, ctx)
    prompts = _prompts(body, ctx)
    for p in prompts:
        check_prompt_length(len(p), ctx)
    n = samples(body, ctx)
    echo = body.get("echo", False)
    if not isinstance(echo, bool) and echo is not None:
        raise field_error("echo", "must be a boolean")
    prompt_logprobs = body.get("prompt_logprobs")  # vLLM's: each prompt token's logprob and the top n
    if prompt_logprobs is not None:
        if isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, int) or prompt_logprobs < 0:
            raise field_error("prompt_logprobs", "an integer >= 0 (top logprobs per prompt token)")
        check_logprobs(prompt_logprobs, ctx, "prompt_logprobs")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise field_error("stream", "must be a boolean")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else ()
    if stop is not None and not (stops and all(isinstance(s, str) and s for s in stops)):
        raise field_error("stop", "a non-empty string or a list of them")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise field_error("logprobs", "an integer >= 0 (top logprobs per token)")
    if logprobs is not None:
        check_logprobs(max(logprobs, 1), ctx, "logprobs")
    max_tokens = number_field(body, "max_tokens", 16, int)
    if max_tokens < 0 or (max_tokens == 0 and not echo and prompt_logprobs is None):
        raise field_error("max_tokens", "must be >= 1 (0 only with echo or prompt_logprobs: the prompt alone)")
    # the prompt is scored when its logprobs are shown: echo with logprobs, prompt_logprobs, or max_tokens 0
    scored = [n for n in (logprobs if echo else None, prompt_logprobs) if n is not None]
    n_scored = max(max(scored), 1) if scored else 0 if max_tokens == 0 else None
    cap = ctx.limits.max_tokens or ctx.capacity
    longest = max(len(p) for p in prompts)
    if max_tokens > cap or longest + max_tokens > ctx.capacity:
        raise APIError(400, f"max_tokens {max_tokens} + the prompt's {longest} tokens exceed this server's "
                            f"context of {ctx.capacity} tokens" if max_tokens <= cap else
                       f"max_tokens: at most {cap}", param="max_tokens", code="context_length_exceeded")
    seed = number_field(body, "seed", None, int)
    if seed is not None and seed < 0:
        raise field_error("seed", "must be >= 0")
    response_id, created, model = new_id(api), int(time.time()), body["model"]
    head = {"id": response_id, "object": "text_completion", "created": created, "model": model}
    choices = []
    for k, (i, p) in enumerate((i, p) for i, p in enumerate(prompts) for _ in range(n)):  # k: the choice's index
        params = sampling(ctx, temperature=number_field(body, "temperature", 1.0),
                          top_p=number_field(body, "top_p", 1.0), max_tokens=max_tokens, seed=sample_seed(seed, k),
                          logprobs=0 if logprobs is None else max(logprobs, 1), body=body,
                          prompt_logprobs=None if n_scored is None else min(n_scored, ctx.max_logprobs))
        text = body["prompt"] if isinstance(body["prompt"], str) else body["prompt"][i]
        # echo: the prompt's text
        shown = (text if isinstance(text, str) else ctx.tokenizer.decode(p)) if echo else None
        translator = CompletionTranslator(k, ctx, stops, logprobs, head, prompt=p, prompt_logprobs=prompt_logprobs,
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
