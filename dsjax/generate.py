"""`dsjax.generate`: batched generation from a Model, on the engine, from text or token ids.

    dsjax.generate(model, ["The capital of France is"], 16)        -> ["<new text>"]
    dsjax.generate(model, [[0, 671, 6102]], 16)                    -> [[<new ids>]]
    dsjax.generate(model, ["Q: 1+1?"], 16, stop=["\\n"], logprobs=3, details=True)
                                                                   -> [Completion(text, ids, ...)]

A text prompt is encoded as [BOS] + tokenizer.encode(text) and gets text back; an id prompt
gets the new ids back. Stop strings are matched on the decoded text on the host, across token
boundaries: the request is cancelled as soon as one appears, and the text is cut before it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from dsjax.api import Model
from dsjax.engine.engine import Engine
from dsjax.engine.requests import TokenEvent, bucket_capacity, check_prompt
from dsjax.engine.sampler import SamplingParams
from dsjax.engine.warm import warm_engine
from dsjax.output import TextRun
from dsjax.tokenizer import Healing, Tokenizer, load_tokenizer

MAX_SLOTS = 32


@dataclasses.dataclass
class Completion:
    """One prompt's generation.

    text: the new text (None for an id prompt when no tokenizer was involved), cut before a
    stop string. ids: the new token ids, the one that ended it included (EOS, a stop id, or
    the token that completed a stop string). finish_reason: "stop" (EOS, a stop id or a stop
    string: `stop` says which) or "length" (max_new_tokens). logprobs (when asked): one
    entry per id, {"token", "logprob", "top_logprobs": [{"token", "logprob"}, ...]}, the
    raw model distribution's (before penalties and temperature), plus "text" with a tokenizer."""

    text: str | None
    ids: list[int]
    prompt_ids: list[int]
    finish_reason: str | None
    stop: str | int | None = None
    logprobs: list[dict] | None = None

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.ids)}

    def to_dict(self) -> dict:
        out = {"text": self.text, "ids": self.ids, "finish_reason": self.finish_reason, "stop": self.stop,
               "usage": self.usage}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out


# --------------------------------------------------------------------------- input checks
def _describe(x) -> str:
    return f"{x!r} ({type(x).__name__})"


def _is_id(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _id_prompt(p, where: str) -> list[int]:
    if not len(p):
        raise ValueError(f"{where} is empty: a prompt needs at least one token")
    check_prompt(p, None, where)  # the engine's own check; the vocabulary is checked at admission
    return [int(t) for t in p]


def prompt_list(prompts) -> list:
    """The prompts as a list of str / list[int], refusing by name what is not a list of prompts."""
    if isinstance(prompts, str):
        raise ValueError(f"prompts must be a list of prompts, got a single string {prompts[:40]!r}: "
                         f"pass [text] for one prompt")
    if isinstance(prompts, np.ndarray):
        if prompts.ndim != 2:
            raise ValueError(f"a prompts array must be [batch, seq] token ids, got shape {prompts.shape}"
                             + (" (wrap one prompt: ids[None])" if prompts.ndim == 1 else ""))
        if not np.issubdtype(prompts.dtype, np.integer):
            raise ValueError(f"a prompts array must hold integer token ids, got dtype {prompts.dtype}")
        return [_id_prompt(row, f"prompts[{i}]") for i, row in enumerate(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of prompts (strings or token id lists), got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, (list, tuple, np.ndarray)):
            out.append(_id_prompt(p, f"prompts[{i}]"))
        elif _is_id(p):
            raise ValueError(f"prompts[{i}] is {_describe(p)}: prompts must be a list of prompts, each a string or "
                             f"a list of token ids; for one prompt of ids pass [[...]], not a flat list of ints")
        else:
            raise ValueError(f"prompts[{i}] is {_describe(p)}: each prompt must be a string or a list of token ids")
    return out


def _per_prompt(value, n: int, name: str) -> list:
    """One value for all prompts, or one per prompt; values pass through unconverted, so
    SamplingParams checks exactly what the caller gave."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: expected one value or one per prompt ({n}), got {len(value)}")
        return list(value)
    return [value] * n


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(stops)


def _stop_ids(stop_token_ids) -> tuple[int, ...]:
    if stop_token_ids is None:
        return ()
    if _is_id(stop_token_ids):
        stop_token_ids = [stop_token_ids]
    if not isinstance(stop_token_ids, (list, tuple, np.ndarray)):
        raise ValueError(f"stop_token_ids must be a list of ints, got {_describe(stop_token_ids)}")
    for t in list(stop_token_ids):
        if not _is_id(t):
            raise ValueError(f"stop_token_ids: {_describe(t)} is not a token id (an int)")
    return tuple(int(t) for t in stop_token_ids)


def _check_count(value, name: str) -> None:
    if not _is_id(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {_describe(value)}")


# --------------------------------------------------------------------------- the run
@dataclasses.dataclass
class GenerationPlan:
    """What one `generate` call runs: the encoded prompts, each one's SamplingParams, the stop
    strings and the tokenizer (None when no prompt is text and nothing needs decoding).
    `generate` is `plan(...)` -> `.engine(model)` -> `.run(engine)`; the CLI runs the same
    steps to keep the engine's counters."""

    prompts: list[list[int]]
    is_text: list[bool]
    params: list[SamplingParams]
    stop: tuple[str, ...]
    tokenizer: Tokenizer | None
    max_new_tokens: int
    num_draft_tokens: int = 0
    spec_policy: str | None = None
    healed: list[Healing | None] | None = None  # per prompt: its token healing (text prompts, when asked)

    def engine_settings(self, model: Model) -> dict | None:
        """The `Engine` keywords of an engine sized for these prompts (None when max_new_tokens
        is 0: nothing to run)."""
        if self.max_new_tokens == 0:
            return None
        n = len(self.prompts)
        longest = max(len(p) for p in self.prompts) + self.max_new_tokens + self.num_draft_tokens
        shards = model.batch_shards()  # under a mesh, slots split evenly over the batch axes
        slots = -(-min(n, MAX_SLOTS) // shards) * shards
        return dict(max_slots=slots, capacity=engine_capacity(longest, model),
                    decode_steps=1 if self.num_draft_tokens else 4, num_draft_tokens=self.num_draft_tokens,
                    spec_policy=self.spec_policy, max_logprobs=max(p.logprobs for p in self.params))

    def engine(self, model: Model) -> Engine | None:
        """A new engine sized for these prompts (None when max_new_tokens is 0)."""
        settings = self.engine_settings(model)
        return None if settings is None else Engine(model, **settings)

    def run_warm(self, model: Model, on_token: Callable[[int, TokenEvent, str], None] | None = None
                 ) -> list[Completion]:
        """`run` on the model's warm engine of this plan's shape (`dsjax.engine.warm`): repeated
        calls skip the engine's set-up, with the tokens a new engine gives."""
        settings = self.engine_settings(model)
        if settings is None:
            return self.run(None, on_token)
        with warm_engine(model, **settings) as engine:
            return self.run(engine, on_token)

    def run(self, engine: Engine | None, on_token: Callable[[int, TokenEvent, str], None] | None = None
            ) -> list[Completion]:
        """Generate; on_token(prompt index, event, new text) is called for each token as it
        arrives (text: what it makes final, "" without a tokenizer or while held back because
        it may begin a stop string)."""
        healed = self.healed or [None] * len(self.prompts)
        runs = [TextRun(self.tokenizer, self.stop, bool(sp.logprobs), h.removed if h else "")
                for sp, h in zip(self.params, healed)]
        if engine is not None:
            by_id = {engine.add_request(p, sp, first_tokens=h.first_tokens if h else None): i
                     for i, (p, sp, h) in enumerate(zip(self.prompts, self.params, healed))}
            for event in engine.run():
                i = by_id[event.request_id]
                run = runs[i]
                text = run.take(event)
                if run.finish_reason is not None and event.finish_reason is None:  # a stop string: end it now
                    engine.cancel(event.request_id)
                if on_token is not None:
                    on_token(i, event, text)
        return [self.completion(i, r) for i, r in enumerate(runs)]

    def completion(self, i: int, run: "TextRun") -> Completion:
        """Prompt i's Completion from its run's bookkeeping (also how `dsjax.batch` reports one)."""
        show_text = self.is_text[i] or self.tokenizer is not None
        return Completion(run.text if show_text else None, run.ids, self.prompts[i], run.finish_reason,
                          run.stop_hit if run.finish_reason == "stop" else None, run.logprobs)


def engine_capacity(longest: int, model: Model) -> int:
    """The cache capacity for sequences of up to `longest` tokens (`bucket_capacity`)."""
    return bucket_capacity(longest, model.config)


def sampling_params(n: int, max_new_tokens: int = 32, temperature=0.0, top_p=1.0, top_k=0, seed=0, *, min_p=0.0,
                    repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, stop_token_ids=None,
                    ignore_eos: bool = False, logprobs: int = 0, logit_bias=None) -> list[SamplingParams]:
    """The SamplingParams of n prompts (each setting: one value or one per prompt), checked
    before anything is loaded or compiled."""
    _check_count(max_new_tokens, "max_new_tokens")
    _check_count(logprobs, "logprobs")
    per = {name: _per_prompt(value, n, name) for name, value in (
        ("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
        ("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty), ("seed", seed))}
    # max_tokens >= 1 is SamplingParams' rule; max_new_tokens 0 means "nothing to generate"
    return [SamplingParams(**{k: v[i] for k, v in per.items()}, max_tokens=max(max_new_tokens, 1),
                           stop_token_ids=_stop_ids(stop_token_ids), ignore_eos=ignore_eos, logprobs=logprobs,
                           logit_bias=dict(logit_bias or {}))
            for i in range(n)]


def plan(model: Model, prompts, max_new_tokens: int = 32, temperature=0.0, top_p=1.0, top_k=0, seed=0,
         num_draft_tokens: int = 0, spec_policy: str | None = None, *, min_p=0.0, repetition_penalty=1.0,
         presence_penalty=0.0, frequency_penalty=0.0, stop=None, stop_token_ids=None, ignore_eos: bool = False,
         logprobs: int = 0, tokenizer: Tokenizer | None = None, token_healing: bool = False,
         logit_bias=None) -> GenerationPlan:
    """Check and encode `generate`'s arguments (see there) into a GenerationPlan."""
    items = prompt_list(prompts)
    _check_count(num_draft_tokens, "num_draft_tokens")
    params = sampling_params(len(items), max_new_tokens, temperature, top_p, top_k, seed, min_p=min_p,
                             repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                             frequency_penalty=frequency_penalty, stop_token_ids=stop_token_ids,
                             ignore_eos=ignore_eos, logprobs=logprobs, logit_bias=logit_bias)
    stops = _stop_strings(stop)
    is_text = [isinstance(p, str) for p in items]
    if tokenizer is None and (any(is_text) or stops):
        tokenizer = load_tokenizer(model)
    ids = [[model.config.bos_token_id] + tokenizer.encode(p) if t else p for p, t in zip(items, is_text)]
    healed = [tokenizer.heal(p) if t and token_healing else None for p, t in zip(ids, is_text)]
    ids = [h.prompt if h else p for p, h in zip(ids, healed)]
    return GenerationPlan(ids, is_text, params, stops, tokenizer, max_new_tokens, int(num_draft_tokens), spec_policy,
                          healed)


def generate(model: Model, prompts, max_new_tokens: int = 32, temperature=0.0, top_p=1.0, top_k=0, seed=0,
             num_draft_tokens: int = 0, spec_policy: str | None = None, *, min_p=0.0, repetition_penalty=1.0,
             presence_penalty=0.0, frequency_penalty=0.0, stop: str | Sequence[str] | None = None,
             stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False, logprobs: int = 0,
             tokenizer: Tokenizer | None = None, token_healing: bool = False, details: bool = False,
             on_token: Callable[[int, TokenEvent, str], None] | None = None,
             logit_bias: dict[int, float] | None = None) -> list:
    """Generate up to max_new_tokens for each prompt, stopping at EOS, a stop id or a stop string.

    prompts: a list whose items are strings (encoded as [BOS] + tokenizer.encode(text)) or
    token id lists / 1-D int arrays; or a [batch, seq] int array. Returns one item per
    prompt: the new text for a string prompt, the new token ids for an id prompt; with
    details=True a `Completion` each (text, ids, prompt_ids, finish_reason, stop, usage,
    logprobs).

    temperature / top_p / top_k / min_p / repetition_penalty / presence_penalty /
    frequency_penalty / seed: one value, or one per prompt; temperature 0 is greedy. A
    request's tokens depend only on its prompt, its settings and its seed.
    stop: strings that end a generation (matched on the decoded text, cut from it);
    stop_token_ids: ids that end it (kept as its last id), besides the model's EOS unless
    ignore_eos. logprobs=n: each token's logprob and the top n (`details=True` shows them).
    logit_bias: {token id: bias in [-100, 100]} added to every prompt's logits (OpenAI's).
    tokenizer: default `load_tokenizer(model)` (the bundled V4 tokenizer), loaded only when
    a prompt is text or stop strings are given.
    token_healing: a text prompt's last token is backed off and the first new token drawn
    from those that begin with its text (`Tokenizer.heal`): a prompt cut at a token
    boundary the training text rarely has (`def f(n):` where code has `):\n`) continues as
    the text would. The completion's text leaves the backed-off text out; its ids and
    prompt_ids are what the model saw and made. Id prompts are never healed.
    num_draft_tokens > 0: speculative decoding with the model's MTP layer (greedy output is
    unchanged; sampled output keeps its distribution), spec_policy "confidence" | "fixed" (None:
    "confidence", but "fixed" in batch-invariant mode).
    on_token(prompt index, TokenEvent, new text): called as each token arrives (streaming)."""
    p = plan(model, prompts, max_new_tokens, temperature, top_p, top_k, seed, num_draft_tokens, spec_policy,
             min_p=min_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
             frequency_penalty=frequency_penalty, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
             logprobs=logprobs, tokenizer=tokenizer, token_healing=token_healing, logit_bias=logit_bias)
    results = p.run_warm(model, on_token)
    if details:
        return results
    return [r.text if text else r.ids for r, text in zip(results, p.is_text)]


def generate_distributed(model, local_prompts: list[list[int]], max_new_tokens: int, **kw) -> list[list[int]]:
    """Each process passes its own prompts (any number, maybe none) and gets back the new
    tokens of exactly those. All processes run one engine over the union of the prompts."""
    counts = multihost_utils.process_allgather(np.array([len(local_prompts)], np.int32))
    counts = np.asarray(counts).reshape(-1)
    longest = int(np.asarray(multihost_utils.process_allgather(
        np.array([max((len(p) for p in local_prompts), default=0)], np.int32))).max())
    padded = np.full((max(1, int(counts.max())), max(1, longest) + 1), -1, np.int32)
    for i, p in enumerate(local_prompts):
        padded[i, 0], padded[i, 1: len(p) + 1] = len(p), p
    every = np.asarray(multihost_utils.process_allgather(padded))  # [processes, max count, longest + 1]
    prompts = [row[1: row[0] + 1].tolist() for proc, n in enumerate(counts) for row in every[proc][:n]]
    results = generate(model, prompts, max_new_tokens, **kw)
    start = int(counts[: jax.process_index()].sum())
    return results[start: start + len(local_prompts)]
