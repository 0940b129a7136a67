"""Requests on the host: what a request asks for, checked once at admission; its life
(waiting -> prefilling -> decoding -> finished | cancelled); how its prompt is cut into
chunks; and how a device output becomes its `TokenEvent`s.

The engine attributes device outputs to `Request` objects, never to the user's request id:
an id may be reused once its request has finished or been cancelled, while the outputs of
the old request are still in flight.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import numbers
from typing import Callable

import numpy as np

from dsjax.config import ModelConfig
from dsjax.engine.constraints import Constraint, pack_mask
from dsjax.engine.sampler import MAX_LOGIT_BIAS, SamplingParams
from dsjax.engine.slots import MAX_STOP_IDS, Admission

# Prompt chunk widths and context buckets grow by SHAPE_GROWTH from MIN_CHUNK / MIN_BUCKET:
# each is a compiled program, so few of them (log4 of the range), and a chunk or a step
# computes / reads less than SHAPE_GROWTH x what it needs.
SHAPE_GROWTH = 4
MIN_CHUNK = 16
MIN_BUCKET = 256


@dataclasses.dataclass
class TokenEvent:
    request_id: str
    token: int | None  # None: a request with max_tokens 0 (prompt_logprobs only) ends with no token
    logprob: float | None  # raw-distribution logprob (requests with SamplingParams.logprobs >= 1)
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None  # None while running; "stop" | "length" when this is the last token
    cached_tokens: int | None = None  # a request's first event: its prompt tokens taken from the prefix cache
    # a request's first event, with SamplingParams.prompt_logprobs: per prompt token, None for the first, else
    # (logprob, top [(id, logprob)] or None, rank) of the raw distribution the tokens before it give
    prompt_logprobs: list | None = None
    # SamplingParams.capture (an engine with capture=...): name -> this token's values, the forward step's that
    # made it (`dsjax.engine.capture`); a request's first event: name -> [P - 1, ...] its earlier prompt positions'
    capture: dict | None = None
    prompt_capture: dict | None = None


@dataclasses.dataclass(eq=False)  # compared by identity: two requests may share an id, never an object
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: tuple[int, ...]  # sorted: the params' stop ids, and the model's EOS ids unless ignore_eos
    on_token: Callable[[TokenEvent], None] | None = None
    constraint: Constraint | None = None  # structured output: the grammar its tokens are sampled under
    first_mask: np.ndarray | None = None  # packed uint32 [words]: the tokens its first one may be (token healing)
    state: str = "waiting"  # waiting | prefilling | decoding | finished | cancelled
    slot: int | None = None
    prefilled: int = 0
    admitted: bool = False  # its first prefill chunk (or restored block), which resets the slot, is planned
    dispatched: int = 0  # tokens the device will have cached (upper bound while decoding)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    target_steps: int = 0  # speculative engines: verify steps this request took part in
    drafts_proposed: int = 0  # drafts sent to verification
    drafts_accepted: int = 0
    decode_tokens: int = 0  # tokens those steps produced (all but the prefill's first)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not prefilled
    replayed_tokens: int = 0  # prompt tokens a cached block held but that were prefilled again
    block_keys: list | None = None  # the prefix cache's chain keys of its prompt's blocks
    prompt_logprobs: list = dataclasses.field(default_factory=lambda: [None])  # read back chunk by chunk
    prompt_capture: dict = dataclasses.field(default_factory=dict)  # name -> chunks [n, ...] read back

    def __repr__(self) -> str:  # short, so that a printed StepPlan stays readable
        return (f"Request({self.request_id!r}, {self.state}, slot={self.slot}, prompt={len(self.prompt)}, "
                f"prefilled={self.prefilled}, tokens={len(self.tokens)})")

    def take_scores(self, host, row: int, start: int, n: int) -> None:
        """The prompt logprobs of one prefill chunk (host copy of a `DeviceOutput`, row `row`): its
        positions start..start+n-1 each score the prompt token after them (the last position of
        the prompt scores nothing: its logits give the first generated token)."""
        top_n = self.params.prompt_logprobs
        for i in range(min(n, len(self.prompt) - 1 - start)):
            top = None
            if top_n:
                ids, values = host.prompt_top_ids[0, row, i, :top_n], host.prompt_top_values[0, row, i, :top_n]
                top = [(int(t), float(v)) for t, v in zip(ids, values)]
            self.prompt_logprobs.append((float(host.prompt_logprob[0, row, i]), top, int(host.prompt_rank[0, row, i])))

    def take_capture(self, host, row: int, start: int, n: int) -> None:
        """The captured points of one prefill chunk (host copy of a `DeviceOutput`, row `row`) at
        positions start..start+n-1, but for the prompt's last (its first token's event has it)."""
        keep = min(n, len(self.prompt) - 1 - start)
        for name, values in host.prompt_capture.items():
            self.prompt_capture.setdefault(name, []).append(values[0, row, :keep])

    @property
    def done(self) -> bool:
        return self.state in ("finished", "cancelled")

    @property
    def prefill_len(self) -> int:
        """Prompt tokens prefill caches. A constrained request leaves its last one to its
        first decode step, so that its first token is sampled under the grammar's mask."""
        return len(self.prompt) - (self.constraint is not None)

    def next_chunk(self, prefill_chunk: int, aligned: bool = False) -> list[int]:
        """The next prompt chunk. The first takes what whole chunks leave over (1 to
        prefill_chunk tokens), every later one prefill_chunk tokens: only a prompt's first
        chunk is narrower than prefill_chunk, and it starts at position 0, so prefill
        compiles (widths + context buckets) programs, not (widths x buckets), and pads at
        most one chunk per prompt. Chunks cover `prefill_len` tokens: a constrained
        request's one-token prompt gets one empty chunk (it only admits the request).
        aligned (`Engine.aligned_chunks`: a prefix cache's blocks, V4.1's published-key rule):
        chunks end on the absolute prefill_chunk grid, every one a whole block but the last."""
        if aligned:
            n = prefill_chunk - self.prefilled % prefill_chunk
        else:
            n = (self.prefill_len - 1) % prefill_chunk + 1 if self.prefilled == 0 else prefill_chunk
        return self.prompt[self.prefilled: self.prefilled + min(n, self.prefill_len - self.prefilled)]

    def book(self, host, step: int, row: int) -> TokenEvent:
        """Take the token at (step, row) of a host copy of a `DeviceOutput`; the last one
        (finished on the device) ends the request."""
        first = not self.tokens
        scores = self.prompt_logprobs if self.params.prompt_logprobs is not None and first else None
        prompt_capture = capture = None
        if self.params.capture:
            if first:
                prompt_capture = {n: np.concatenate(v) for n, v in self.prompt_capture.items()}
            if host.capture is not None:
                capture = {n: v[step, row] for n, v in host.capture.items()}
        if self.params.max_tokens == 0:  # scored only: the token the device had to sample is dropped
            self.state, self.finish_reason = "finished", "length"
            return TokenEvent(self.request_id, None, None, None, "length", self.cached_tokens, scores,
                              prompt_capture=prompt_capture)
        token = int(host.tokens[step, row])
        top = None
        if self.params.logprobs:
            n = self.params.logprobs
            top = [(int(i), float(v)) for i, v in zip(host.top_ids[step, row][:n], host.top_values[step, row][:n])]
        finish = None
        if host.finished[step, row]:
            finish = "stop" if token in self.stop_ids else "length"
            self.state, self.finish_reason = "finished", finish
        logprob = float(host.logprob[step, row]) if self.params.logprobs else None  # computed when a row asks
        self.tokens.append(token)
        self.logprobs.append(logprob)
        return TokenEvent(self.request_id, token, logprob, top, finish,
                          self.cached_tokens if len(self.tokens) == 1 else None, scores, capture, prompt_capture)


_SETTINGS = {"temperature": np.float32, "top_k": np.int32, "top_p": np.float32, "min_p": np.float32,
             "repetition_penalty": np.float32, "presence_penalty": np.float32, "frequency_penalty": np.float32,
             "seed": np.uint32, "logprobs": np.int32}


def admission(rows: list[Request | None]) -> Admission:
    """The `Admission` of one prefill call, per row: a request (a row whose chunk is its
    prompt's first) resets its slot to its settings; rows of None (a later chunk, or not
    prefilled in this call) keep theirs."""
    n = len(rows)
    reset = np.array([r is not None for r in rows])
    sampling = {k: np.zeros(n, dt) for k, dt in _SETTINGS.items()} | {"prompt_len": np.zeros(n, np.int32)}
    sampling |= {"bias_ids": np.zeros((n, MAX_LOGIT_BIAS), np.int32),
                 "bias_values": np.zeros((n, MAX_LOGIT_BIAS), np.float32)}
    max_tokens, stops = np.zeros(n, np.int32), np.full((n, MAX_STOP_IDS), -1, np.int32)
    for i in np.flatnonzero(reset):
        r = rows[i]
        for k in _SETTINGS:
            sampling[k][i] = getattr(r.params, k)
        sampling["prompt_len"][i], max_tokens[i] = len(r.prompt), max(1, r.params.max_tokens)  # 0: scored only
        stops[i, : len(r.stop_ids)] = r.stop_ids
        for j, (token, bias) in enumerate(r.params.logit_bias):
            sampling["bias_ids"][i, j], sampling["bias_values"][i, j] = token, bias
    return Admission(reset, sampling, max_tokens, stops)


def stop_ids(params: SamplingParams, eos_token_ids) -> tuple[int, ...]:
    """The tokens that end a request: its stop ids, and the model's EOS ids unless ignore_eos."""
    return tuple(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))))


def context_bucket(tokens_needed: int, capacity: int | None = None, smallest: int = MIN_BUCKET) -> int:
    """How many cached tokens a step may read (static per compiled program): the smallest
    `smallest` x SHAPE_GROWTH^i holding `tokens_needed`, capped at the capacity. A step's
    cost follows the longest sequence in the batch, not the cache capacity, and
    steady-state decode reuses one program per bucket."""
    bucket = smallest
    while bucket < tokens_needed:
        bucket *= SHAPE_GROWTH
    return bucket if capacity is None else min(bucket, capacity)


def context_buckets(capacity: int, smallest: int = MIN_BUCKET) -> list[int]:
    """Every context bucket of a `capacity`-token cache (capacity 4096: 256, 1024, 4096;
    1M: 7 buckets; from `smallest` on)."""
    buckets, bucket = [], smallest
    while bucket < capacity:
        buckets.append(bucket)
        bucket *= SHAPE_GROWTH
    return buckets + [capacity]


# A bucket below which reading the whole bucket's cache adds at most this share of a decode
# step's weight bytes is not worth its programs (each bucket is a prefill and a decode program
# per shape, 5-15 s of XLA:CPU compile each for the built-in model).
BUCKET_WORTH = 1 / 8


def smallest_useful_bucket(step_bytes: Callable[[int], tuple[float, float]], capacity: int) -> int:
    """The smallest context bucket worth a program of its own: buckets at which reading the
    cache costs at most BUCKET_WORTH of the step's weight bytes run at the largest such
    bucket instead. step_bytes(context) -> (cache bytes, weight bytes) of a decode step of
    the engine's rows."""
    smallest = MIN_BUCKET
    for bucket in context_buckets(capacity)[1:]:
        cache, weights = step_bytes(bucket)
        if cache > BUCKET_WORTH * weights:
            break
        smallest = bucket
    return smallest


def bucket_capacity(tokens: int, cfg: ModelConfig) -> int:
    """A cache capacity holding `tokens`: the power of two >= MIN_BUCKET holding it, rounded
    up to a multiple of the compression ratios (what `dsjax.generate` allocates, and at most
    what a slot can use). Memory, not a program per size: finer than the context buckets."""
    ratio = cfg.max_compress_ratio
    return -(-max(MIN_BUCKET, 1 << (tokens - 1).bit_length()) // ratio) * ratio


def chunk_length(tokens: int, prefill_chunk: int) -> int:
    """The padded width of a prompt chunk of `tokens` tokens: MIN_CHUNK x SHAPE_GROWTH^i
    covering them, at most prefill_chunk (a short prompt does not pay for a full chunk)."""
    width = MIN_CHUNK
    while width < tokens:
        width *= SHAPE_GROWTH
    return min(prefill_chunk, width)


def chunk_lengths(prefill_chunk: int) -> list[int]:
    """Every chunk width prefill may dispatch (prefill_chunk 256: 16, 64, 256)."""
    return sorted({chunk_length(n, prefill_chunk) for n in range(1, prefill_chunk + 1)})


def check_prompt(prompt, vocab_size: int | None, where: str = "prompt") -> None:
    """A prompt is a non-empty sequence of int token ids inside the vocabulary (vocab_size
    None: not checked here); the error names the first id that is not, as `where[index]`."""
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"{where} must be a list of token ids, got a {type(prompt).__name__} "
                         f"(tokenize the text first)")
    if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
        raise ValueError(f"{where} must be a 1-D list of token ids, got an array of shape {prompt.shape}")
    if not isinstance(prompt, (collections.abc.Sequence, np.ndarray)):
        raise ValueError(f"{where} must be a list of token ids, got {type(prompt).__name__}")
    if not len(prompt):
        raise ValueError(f"{where} must contain at least one token")
    if isinstance(prompt, np.ndarray):
        ints = prompt.dtype.kind in "iu"
        lo, hi = (prompt.min(), prompt.max()) if ints else (0, 0)
    else:  # Python lists: look at each element's type (np.asarray would turn True into 1, 1.7 into a float array)
        ints = all(issubclass(t, numbers.Integral) and not issubclass(t, bool) for t in set(map(type, prompt)))
        lo, hi = (min(prompt), max(prompt)) if ints else (0, 0)
    if not ints:
        i, bad = next((i, t) for i, t in enumerate(prompt)
                      if not isinstance(t, numbers.Integral) or isinstance(t, (bool, np.bool_)))
        raise ValueError(f"{where}[{i}] is {bad!r} ({type(bad).__name__}): token ids must be ints")
    if vocab_size is not None and (lo < 0 or hi >= vocab_size):
        i, bad = next((i, int(t)) for i, t in enumerate(prompt) if not 0 <= t < vocab_size)
        raise ValueError(f"{where}[{i}]: token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_request(prompt, params: SamplingParams, stops: tuple[int, ...], *, vocab_size: int, max_positions: int,
                  capacity: int, num_draft_tokens: int, max_logprobs: int) -> None:
    """Refuse, with the reason, a request the engine cannot serve. Types and ranges of the
    settings were checked when `params` was made; here, what depends on the model and the
    engine: ids within the vocabulary, lengths within the model's positions
    (`max_positions`) and the engine's cache."""
    check_prompt(prompt, vocab_size)
    bad_stops = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad_stops:
        raise ValueError(f"stop_token_ids: token id {bad_stops[0]} is outside the vocabulary [0, {vocab_size})")
    bad_bias = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad_bias:
        raise ValueError(f"logit_bias: token id {bad_bias[0]} is outside the vocabulary [0, {vocab_size})")
    if params.top_k > vocab_size:
        raise ValueError(f"top_k={params.top_k} exceeds the vocabulary size ({vocab_size}); use at most "
                         f"{vocab_size}, or 0 for no top-k limit")
    total = len(prompt) + params.max_tokens
    if total > max_positions:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                         f"model's max_position_embeddings ({max_positions}); lower max_tokens or shorten the prompt")
    k = num_draft_tokens  # a verify step may write k positions past the last kept token
    if len(prompt) + params.max_tokens + k > capacity:
        drafts = f" + num_draft_tokens ({k})" if k else ""
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}){drafts} exceeds the "
                         f"engine's cache capacity ({capacity} tokens)")
    if k and (params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty):
        raise ValueError("penalties are not supported with speculative decoding (their token statistics "
                         "would change inside the draft chain); use an engine with num_draft_tokens=0")
    if k and params.logit_bias:
        raise ValueError("logit_bias is not supported with speculative decoding (the verify step compares "
                         "drafts with the model's own tokens); use an engine with num_draft_tokens=0")
    if params.logprobs > max_logprobs:
        raise ValueError(f"logprobs={params.logprobs} exceeds the engine's max_logprobs={max_logprobs}")
    if params.prompt_logprobs is not None:
        if params.prompt_logprobs > max_logprobs:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds the engine's "
                             f"max_logprobs={max_logprobs}")
        if k:
            raise ValueError("prompt_logprobs is not supported with speculative decoding (its prefill runs the "
                             "drafter's chunk program); use an engine with num_draft_tokens=0")
    if len(stops) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(stops)}")


def max_capacity(cfg: ModelConfig) -> int:
    """The largest cache capacity a slot can use: what `bucket_capacity` gives the model's
    longest sequence (`max_position_embeddings`): `dsjax.generate` sizes capacities so."""
    return bucket_capacity(cfg.max_position_embeddings, cfg)


def check_constraint(constraint, params: SamplingParams, *, vocab_size: int, speculative: bool) -> None:
    """A request's structured-output `constraint` against the engine: a fresh Constraint for this
    vocabulary, an engine without speculation, a request that lets the grammar end it."""
    if not isinstance(constraint, Constraint):
        raise TypeError(f"constraint must be a Constraint (ConstraintCompiler.compile), got "
                        f"{type(constraint).__name__}")
    if speculative:
        raise ValueError("structured output (constraint=) is not supported with speculative decoding: drafts "
                         "would have to be drawn and verified under the grammar; use an engine with "
                         "num_draft_tokens=0")
    if constraint.claimed:
        raise ValueError("this Constraint already serves a request; compile one per request")
    if constraint.vocab_size != vocab_size:
        raise ValueError(f"the constraint was compiled for a vocabulary of {constraint.vocab_size} tokens, the "
                         f"model has {vocab_size}")
    if params.ignore_eos:
        raise ValueError("ignore_eos cannot be combined with a constraint: the grammar decides where the "
                         "output ends (EOS is allowed exactly when it is complete)")


def first_tokens_mask(first_tokens, constraint, vocab_size: int) -> np.ndarray:
    """first_tokens (a non-empty sequence of ids in the vocabulary) packed as a mask row."""
    ids = np.asarray(first_tokens)
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise ValueError(f"first_tokens must be a non-empty list of token ids, got {str(first_tokens)[:80]}")
    ids = ids.astype(np.int64)
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise ValueError(f"first_tokens: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if constraint is not None:
        raise ValueError("first_tokens cannot be combined with a constraint (the grammar decides the first token)")
    allowed = np.zeros(vocab_size, bool)
    allowed[ids] = True
    return pack_mask(allowed)
