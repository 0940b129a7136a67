"""`dsjax.score`: the log-likelihood of given tokens, what evaluation harnesses ask of a model
(multiple choice, perplexity, the likelihood of a reference answer).

    dsjax.score(model, ["The capital of France is"], [" Paris"])  # [Score(logprob, is_greedy, ...)]
    dsjax.score(model, [text])                                     # rolling: every token of the text

It runs on the engine: each sequence is a request with `prompt_logprobs` and max_tokens 0, so
the prefill scores each prompt token from the logits it already computes (chunk by chunk,
`dsjax.engine.programs.prompt_scores`) and nothing is generated. A position's score does not
depend on the chunk cut or on the batch (bitwise so in batch-invariant mode). Prompts with
prompt_logprobs skip a prefix cache's lookup: their tokens are recomputed, not restored,
since a cached block keeps the cache it leaves, not the logits of its positions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from dsjax.engine import Engine, SamplingParams
from dsjax.engine.warm import warm_engine
from dsjax.engine.requests import bucket_capacity
from dsjax.tokenizer import Tokenizer, load_tokenizer

MAX_SLOTS = 8


@dataclasses.dataclass
class Score:
    """The log-likelihood of one sequence's scored tokens (a continuation, or every token of a
    rolling score but the first, which has no context)."""

    logprob: float  # their sum (natural log)
    is_greedy: bool  # no token was more likely than any scored one (ties count as greedy)
    token_logprobs: list[float]  # one per scored token
    tokens: list[int]  # the scored tokens
    context: list[int]  # the tokens before them

    @property
    def perplexity(self) -> float:
        return math.exp(-self.logprob / max(1, len(self.tokens)))


def _ids(item, tokenizer_of, bos: list[int], where: str) -> list[int]:
    """A text as [BOS] + its tokens, or a list of ids as it is (the engine checks the ids)."""
    if isinstance(item, str):
        return bos + tokenizer_of().encode(item)
    if not isinstance(item, Sequence) and not hasattr(item, "tolist"):
        raise ValueError(f"{where} must be a string or a list of token ids, got {type(item).__name__}")
    return list(item.tolist() if hasattr(item, "tolist") else item)


def score(model, texts_or_ids: Sequence, continuations: Sequence | None = None, *, engine: Engine | None = None,
          tokenizer: Tokenizer | None = None, batch_invariant: bool | None = None) -> list[Score]:
    """Log-likelihoods under `model`, one `Score` per item.

    continuations None: rolling log-likelihood (perplexity) of each text (encoded as
    [BOS] + its tokens) or id list: every token after the first, given those before it.
    continuations (one per context, strings for string contexts, id lists for id lists):
    the log-likelihood of the continuation given its context (text: [BOS] + the whole text
    encoded, the context's tokens split off, its trailing spaces moved to the continuation,
    as lm-evaluation-harness does).
    engine: run on this engine (its max_logprobs >= 1; e.g. to choose prefill_chunk, a
    prefix cache, batch_invariant), else the model's warm engine of these sequences' shape
    (`dsjax.engine.warm`)."""
    items = list(texts_or_ids)
    if not items:
        return []
    tok = [tokenizer]

    def tokenizer_of():
        if tok[0] is None:
            tok[0] = load_tokenizer(model)
        return tok[0]

    bos = [model.config.bos_token_id] if model.config.bos_token_id is not None else []
    if continuations is None:
        seqs = [_ids(x, tokenizer_of, bos, f"texts_or_ids[{i}]") for i, x in enumerate(items)]
        splits = [1] * len(seqs)
    else:
        continuations = list(continuations)
        if len(continuations) != len(items):
            raise ValueError(f"{len(items)} contexts and {len(continuations)} continuations: give one each")
        seqs, splits = [], []
        for i, (ctx, cont) in enumerate(zip(items, continuations)):
            if isinstance(ctx, str) != isinstance(cont, str):
                raise ValueError(f"continuations[{i}]: a context and its continuation are both text or both ids")
            if isinstance(ctx, str):  # lm-evaluation-harness's split: context spaces move to the continuation,
                cut = len(ctx.rstrip())  # the whole text is encoded and the context's tokens split off
                ctx, cont = ctx[:cut], ctx[cut:] + cont
                whole, c = (_ids(x, tokenizer_of, bos, f"texts_or_ids[{i}]") for x in (ctx + cont, ctx))
                t = whole[len(c):]
            else:
                c, t = _ids(ctx, tokenizer_of, bos, f"texts_or_ids[{i}]"), [int(x) for x in cont]
            if not t:
                raise ValueError(f"continuations[{i}] is empty: nothing to score")
            if not c:
                raise ValueError(f"texts_or_ids[{i}]: an empty context (the first token has no logprob)")
            seqs.append(c + t)
            splits.append(len(c))
    for i, s in enumerate(seqs):
        if len(s) < 2:
            raise ValueError(f"texts_or_ids[{i}] has {len(s)} token(s): a rolling score needs at least 2")
    if engine is None:
        slots = min(len(seqs), MAX_SLOTS)
        with warm_engine(model, max_slots=slots, capacity=bucket_capacity(max(map(len, seqs)) + 1, model.config),
                         max_logprobs=1, batch_invariant=batch_invariant) as engine:
            return _scores(engine, seqs, splits)
    if engine.max_logprobs < 1:
        raise ValueError("score: the engine needs max_logprobs >= 1 (whether each token is the greedy one)")
    return _scores(engine, seqs, splits)


def _scores(engine: Engine, seqs: list[list[int]], splits: list[int]) -> list[Score]:
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    order = {engine.add_request(s, params): i for i, s in enumerate(seqs)}
    scores: list = [None] * len(seqs)
    for event in engine.run():
        scores[order[event.request_id]] = event.prompt_logprobs
        engine.forget(event.request_id)
    out = []
    for s, k, entries in zip(seqs, splits, scores):
        scored = entries[k:]  # entry j scores token j
        lps = [entry[0] for entry in scored]
        greedy = all(entry[2] == 1 for entry in scored)  # (rank 1: no token more likely)
        out.append(Score(float(sum(lps)), greedy, lps, s[k:], s[:k]))
    return out
