"""Input lines -> checked records, each with its prompt ids, SamplingParams and how its
tokens become an output line. Nothing here converts a request itself: raw records go
through `dsjax.generate.plan` (the checks and encoding of `dsjax.generate`), OpenAI batch
lines through `dsjax.protocol.prepare` (deepseek-recipe's conversion, as served).

    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}}
    {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "def f(n):"}}
    {"id": "c", "prompt": "def f(n):", "max_tokens": 16, "temperature": 0.7, "seed": 3}
    {"id": "d", "prompt_ids": [0, 100, 200], "stop_token_ids": [1]}
    {"id": "e", "prompt": "def f(n):", "prompt_logprobs": 1, "max_tokens": 0}   # score the prompt

A record without a seed gets one derived from the run's seed and its id (`derived_seed`),
so its tokens do not depend on the order records run in.

A job that records routing (`dsjax batch --record-routing`, `run(..., record_routing=True)`)
adds each record's expert load to its output line: "expert_counts": {"prompt": [[n] * E] * L,
"generated": ...}, the tokens each layer routed to each expert, over the prompt's positions
but the last and over the steps that made the generated tokens (`dsjax.engine.capture`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import numpy as np

from dsjax.engine import SamplingParams, TokenEvent
from dsjax.engine.capture import expert_counts
from dsjax.generate import plan
from dsjax.output import TextRun
from dsjax.protocol import CHAT, COMPLETIONS, APIError, Context, prepare

URLS = {CHAT.path: CHAT, COMPLETIONS.path: COMPLETIONS}
RAW_FIELDS = {"id", "prompt", "prompt_ids", "max_tokens", "temperature", "top_p", "top_k", "min_p",
              "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
              "ignore_eos", "logprobs", "token_healing", "prompt_logprobs"}


class RecordError(ValueError):
    """A line the job cannot run; the message says why (its line number is the record's)."""


@dataclasses.dataclass
class Record:
    """One checked input line: what the engine runs (prompt, params, first_tokens) and the
    state that turns its TokenEvents into the output line (`start()` / `take()` / `result()`)."""

    line: int  # 1-based line of the input file
    id: Any
    seed: int
    prompt: list[int]
    params: SamplingParams
    first_tokens: list[int] | None = None
    _plan: Any = None  # raw: a one-prompt GenerationPlan
    _make_job: Any = None  # OpenAI: () -> a fresh protocol Job with one choice (each run: resume, verify)
    _job: Any = None
    _run: Any = None
    ids: list[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None  # raw records with prompt_logprobs: from the first event
    routing: dict | None = None  # recording routing: "prompt" / "generated" -> expert counts [L, E]

    def start(self, routing: tuple[int, int] | None = None) -> None:
        """Reset the output state; routing: (layers, experts) to count expert load in (the
        engine captures each token's experts), or None."""
        self.ids, self.prompt_logprobs = [], None
        self.routing = None if routing is None else {k: np.zeros(routing, np.int64) for k in ("prompt", "generated")}
        if self._plan is not None:
            h = self._plan.healed[0]
            self._run = TextRun(self._plan.tokenizer, self._plan.stop, bool(self.params.logprobs),
                                h.removed if h else "")
        else:
            self._job = self._make_job()
            self._job.choices[0].translator.start()

    @property
    def stopped(self) -> bool:
        """A stop string ended it before the engine did (the caller cancels the request)."""
        if self._plan is not None:
            return self._run.finish_reason is not None
        return self._job.choices[0].translator.stopped

    def take(self, event: TokenEvent) -> None:
        if event.prompt_logprobs is not None and self._plan is not None:
            self.prompt_logprobs = [None] + [{"token": t, "logprob": e[0], "rank": e[2],
                                              "top_logprobs": [{"token": i, "logprob": v} for i, v in e[1] or []]}
                                             for t, e in zip(self.prompt[1:], event.prompt_logprobs[1:])]
        if self.routing is not None:
            for part, trace in (("prompt", event.prompt_capture), ("generated", event.capture)):
                if trace:
                    self.routing[part] += expert_counts(trace, *self.routing[part].shape)
        if event.token is not None:
            self.ids.append(event.token)
        if self._plan is not None:
            self._run.take(event)
        elif not self._job.choices[0].translator.stopped:
            self._job.choices[0].translator.push([event])

    def result(self, finish_reason: str | None) -> dict:
        """The output line (a dict): id, seed, text, ids, finish_reason, usage (+ logprobs, stop,
        response, expert_counts)."""
        out = self._result(finish_reason)
        if self.routing is not None:
            out["expert_counts"] = {k: v.tolist() for k, v in self.routing.items()}
        return out

    def _result(self, finish_reason: str | None) -> dict:
        if self._plan is not None:
            c = self._plan.completion(0, self._run)
            out = {"id": self.id, "seed": self.seed, **c.to_dict()}
            if self.params.prompt_logprobs is not None:  # per prompt token: null, then its logprob, rank, top n
                out["prompt_logprobs"] = self.prompt_logprobs
            return out
        translator = self._job.choices[0].translator
        translator.finish(finish_reason)
        body = self._job.response()
        body = json.loads(body) if isinstance(body, str) else body
        body["id"], body["created"] = f"batch-{self.id}", 0  # the API's random id and clock: not results
        choice = body["choices"][0]
        text = choice["message"].get("content") if "message" in choice else choice.get("text")
        out = {"id": self.id, "seed": self.seed, "text": text, "ids": list(self.ids),
               "finish_reason": choice.get("finish_reason"), "usage": body.get("usage")}
        if choice.get("logprobs") is not None:
            out["logprobs"] = choice["logprobs"]
        return {**out, "response": body}


def derived_seed(run_seed: int, record_id) -> int:
    """A record's seed when it gives none: from the run seed and its id only (uint32)."""
    digest = hashlib.sha256(f"{run_seed}\0{json.dumps(record_id)}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def record_id(obj) -> Any:
    """The record's id (custom_id or id), or None when it has none usable."""
    if not isinstance(obj, dict):
        return None
    rid = obj.get("custom_id", obj.get("id"))
    return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) and rid != "" else None


def parse(obj, line: int, *, model, tokenizer, ctx: Context, run_seed: int, max_new_tokens: int) -> Record:
    """One input object -> a Record; RecordError says what is wrong."""
    if not isinstance(obj, dict):
        raise RecordError(f"a record must be a JSON object, got {type(obj).__name__}")
    rid = record_id(obj)
    if rid is None:
        raise RecordError('no id: give "custom_id" (OpenAI batch lines) or "id" (a string or an integer)')
    if "body" in obj or "url" in obj:
        return _openai(obj, line, rid, ctx, run_seed, max_new_tokens)
    return _raw(obj, line, rid, model, tokenizer, run_seed, max_new_tokens)


def _raw(obj: dict, line: int, rid, model, tokenizer, run_seed: int, max_new_tokens: int) -> Record:
    unknown = sorted(set(obj) - RAW_FIELDS)
    if unknown:
        raise RecordError(f"unknown field(s) {', '.join(unknown)} (a raw record takes {', '.join(sorted(RAW_FIELDS))})")
    if ("prompt" in obj) == ("prompt_ids" in obj):
        raise RecordError('give exactly one of "prompt" (text) and "prompt_ids" (token ids)')
    prompt = obj.get("prompt", obj.get("prompt_ids"))
    if "prompt" in obj and not isinstance(prompt, str):
        raise RecordError(f'"prompt" must be a string, got {type(prompt).__name__} (ids go in "prompt_ids")')
    if "prompt_ids" in obj and not isinstance(prompt, list):
        raise RecordError(f'"prompt_ids" must be a list of token ids, got {type(prompt).__name__}')
    max_tokens = obj.get("max_tokens", max_new_tokens)
    scored = obj.get("prompt_logprobs")
    if scored is not None and (isinstance(scored, bool) or not isinstance(scored, int) or scored < 0):
        raise RecordError(f"prompt_logprobs must be an integer >= 0 (top logprobs per prompt token), got "
                          f"{json.dumps(scored)}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < (0 if scored is not None else 1):
        raise RecordError(f"max_tokens must be an integer >= 1 (0 with prompt_logprobs: score the prompt only), got "
                          f"{json.dumps(max_tokens)}")
    seed = obj.get("seed")
    seed = derived_seed(run_seed, rid) if seed is None else seed
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
             "stop", "stop_token_ids", "ignore_eos", "logprobs", "token_healing")
    settings = {k: obj[k] for k in names if obj.get(k) is not None}
    try:
        p = plan(model, [prompt], max(max_tokens, 1), seed=seed, tokenizer=tokenizer, **settings)
        if scored is not None:
            p.params[0] = dataclasses.replace(p.params[0], prompt_logprobs=scored, max_tokens=max_tokens)
    except (ValueError, TypeError) as e:
        raise RecordError(str(e).removeprefix("SamplingParams: ").replace("prompts[0]", "prompt")) from None
    h = p.healed[0]
    return Record(line, rid, seed, p.prompts[0], p.params[0], h.first_tokens if h else None, _plan=p)


def _openai(obj: dict, line: int, rid, ctx: Context, run_seed: int, max_new_tokens: int) -> Record:
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise RecordError(f"unknown field(s) {', '.join(unknown)} (an OpenAI batch line has custom_id, method, url, "
                          f"body)")
    if obj.get("method", "POST") != "POST":
        raise RecordError(f'method must be "POST", got {json.dumps(obj.get("method"))}')
    api = URLS.get(obj.get("url"))
    if api is None:
        raise RecordError(f"url must be one of {', '.join(URLS)}, got {json.dumps(obj.get('url'))}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RecordError(f'"body" must be a JSON object, got {type(body).__name__}')
    name = ctx.names[0]
    if body.get("model", name) != name:
        raise RecordError(f"body.model is {json.dumps(body['model'])}, this job runs {name!r} (leave model out, or "
                          f"name the job's model)")
    if body.get("stream"):
        raise RecordError("body.stream: a batch job answers each request whole; leave stream out")
    if body.get("n", 1) != 1:
        raise RecordError("body.n: one choice per line (repeat the line with another custom_id instead)")
    seed = body.get("seed")
    seed = derived_seed(run_seed, rid) if seed is None else seed
    body = {**body, "model": name, "seed": seed, "stream": False}
    if api is COMPLETIONS:
        body.setdefault("max_tokens", max_new_tokens)
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = max_new_tokens

    def job():
        try:
            return prepare(api, body, ctx)
        except APIError as e:
            raise RecordError(e.message) from None

    first = job()
    if len(first.choices) != 1:
        if body.get("n") not in (None, 1):
            raise RecordError("body.n: one sample per line (write n lines, each with its own seed)")
        raise RecordError("body.prompt: one prompt per line (split a list of prompts over several lines)")
    choice = first.choices[0]
    if choice.constraint is not None:
        raise RecordError("structured output (response_format / tools with a required call) is not supported by "
                          "dsjax batch yet")
    return Record(line, rid, choice.params.seed, choice.prompt, choice.params, _make_job=job)


def read_lines(data: bytes) -> list[tuple[int, Any, str | None]]:
    """(line number, parsed JSON or None, error or None) of each non-blank line."""
    out = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            out.append((n, json.loads(raw), None))
        except (ValueError, UnicodeDecodeError) as e:
            out.append((n, None, f"not valid JSON: {e}"))
    return out
