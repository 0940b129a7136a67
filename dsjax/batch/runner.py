"""Run checked records on one Engine: continuous batching over the whole input, admitted
shortest prompt first (throughput), each record's tokens independent of that order (its
own seed; in batch-invariant mode its logits too).

    results = dsjax.batch.run(model, [{"id": "a", "prompt": "def f(n):", "max_tokens": 8}, ...])

`run` is the notebook API; `dsjax batch` (`dsjax.batch.job`) runs the same steps with a
durable output file around them: `check` -> `make_engine` -> `execute`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any, Callable

from tqdm import tqdm

from dsjax.api import Model
from dsjax.batch.records import Record, RecordError, parse, read_lines, record_id
from dsjax.engine import Engine, PrefixCacheOptions
from dsjax.engine.capture import ROUTING
from dsjax.engine.requests import bucket_capacity, max_capacity
from dsjax.protocol import Context, Limits
from dsjax.tokenizer import Tokenizer, load_tokenizer

MAX_LOGPROBS = 20  # what a record may ask for (OpenAI's top_logprobs limit)


@dataclasses.dataclass
class Checked:
    """An input, checked: the records that run (input order), and an error line for each
    line that cannot (by line number)."""

    records: list[Record]
    errors: dict[int, dict]

    @property
    def lines(self) -> list[int]:
        return sorted([r.line for r in self.records] + list(self.errors))

    def error_messages(self) -> list[str]:
        return [f"line {n}: {e['error']['message']}" for n, e in sorted(self.errors.items())]


def error_line(line: int, rid, message: str) -> dict:
    return {"id": rid, "error": {"line": line, "message": message}}


def context(model: Model, tokenizer: Tokenizer, name: str) -> Context:
    """The serving conversion context, sized by the model (not by an engine: the engine is
    sized afterwards, by the records)."""
    return Context((name,), tokenizer, tuple(model.config.eos_token_ids), max_capacity(model.config), MAX_LOGPROBS,
                   Limits(max_prompts=1, request_timeout=None))


def check(model: Model, items: list[tuple[int, Any, str | None]], *, tokenizer: Tokenizer, name: str,
          seed: int = 0, max_new_tokens: int = 256) -> Checked:
    """(line, parsed JSON or None, JSON error or None) -> Checked. Ids must be unique: a
    repeated id is an error on the later line, naming the first."""
    ctx = context(model, tokenizer, name)
    records, errors, first = [], {}, {}
    for line, obj, bad_json in items:
        rid = record_id(obj)
        try:
            if bad_json is not None:
                raise RecordError(bad_json)
            key = json.dumps(rid)
            if rid is not None and key in first:
                raise RecordError(f"id {key} is used on line {first[key]} and line {line}: ids must be unique")
            records.append(parse(obj, line, model=model, tokenizer=tokenizer, ctx=ctx, run_seed=seed,
                                 max_new_tokens=max_new_tokens))
            first[key] = line
        except RecordError as e:
            if rid is not None and json.dumps(rid) not in first:
                first[json.dumps(rid)] = line
            errors[line] = error_line(line, rid, str(e))
    return Checked(records, errors)


def make_engine(model: Model, checked: Checked, *, max_slots: int = 8, batch_invariant: bool | None = None,
                decode_steps: int = 4, prefill_chunk: int = 256, capacity: int | None = None,
                num_draft_tokens: int = 0, prefix_cache: PrefixCacheOptions | None = None,
                record_routing: bool = False) -> Engine | None:
    """One engine for every record (capacity: the longest prompt + max_tokens over all of
    them, so a resumed run has the same shapes; or `capacity`, the whole job's, when these
    records are one part of it); records it refuses become error lines. num_draft_tokens >
    0: speculative decoding with the model's MTP layer (one decode step per dispatch).
    prefix_cache: records sharing a prompt prefix compute it once (`Engine(prefix_cache=)`).
    record_routing: the engine captures each token's experts, and `execute` writes each
    record's expert counts (not with speculation or a prefix cache)."""
    limit = model.config.max_position_embeddings
    for r in checked.records:  # before sizing: one over-long record must not size every slot's cache
        if len(r.prompt) + r.params.max_tokens > limit:
            checked.errors[r.line] = error_line(r.line, r.id, f"prompt ({len(r.prompt)} tokens) + max_tokens "
                                                f"({r.params.max_tokens}) exceeds the model's {limit} positions")
    checked.records = [r for r in checked.records if r.line not in checked.errors]
    if not checked.records:
        return None
    if capacity is None:
        longest = max(len(r.prompt) + r.params.max_tokens for r in checked.records) + num_draft_tokens
        capacity = min(bucket_capacity(longest, model.config), max_capacity(model.config))
    engine = Engine(model, max_slots=max_slots, capacity=capacity, prefill_chunk=prefill_chunk,
                    batch_invariant=batch_invariant, num_draft_tokens=num_draft_tokens,
                    decode_steps=effective_decode_steps(decode_steps, num_draft_tokens),
                    max_logprobs=max(max(r.params.logprobs, r.params.prompt_logprobs or 0) for r in checked.records),
                    prefix_cache=prefix_cache, capture=ROUTING if record_routing else ())
    kept = []
    for r in checked.records:
        try:
            engine.validate(r.prompt, r.params)
            kept.append(r)
        except (ValueError, TypeError) as e:
            checked.errors[r.line] = error_line(r.line, r.id, str(e))
    checked.records = kept
    return engine


def effective_decode_steps(decode_steps: int, num_draft_tokens: int) -> int:
    """A speculative engine dispatches one verify step at a time."""
    return 1 if num_draft_tokens else decode_steps


def execute(engine: Engine, records: list[Record], on_result: Callable[[Record, dict], None], *,
            progress: bool | None = False) -> int:
    """Generate every record, calling on_result(record, output dict) as each finishes.
    progress: a tqdm bar on stderr (None: only on a terminal). An engine that captures routing
    (`make_engine(record_routing=True)`): each output also has the record's expert counts.
    Returns the tokens made."""
    order = sorted(records, key=lambda r: (len(r.prompt), r.line))
    cfg, by_request = engine.cfg, {}
    routing = (cfg.num_hidden_layers, cfg.n_routed_experts) if engine.capture else None
    for r in order:
        r.start(routing)
        params = dataclasses.replace(r.params, capture=True) if routing else r.params
        by_request[engine.add_request(r.prompt, params, request_id=f"line-{r.line}",
                                      first_tokens=r.first_tokens)] = r
    tokens, start = 0, time.perf_counter()
    with tqdm(total=len(order), unit="rec", file=sys.stderr, disable=None if progress is None else not progress,
              dynamic_ncols=True, desc="dsjax batch") as bar:
        for event in engine.run():
            r = by_request[event.request_id]
            r.take(event)
            tokens += event.token is not None  # (a scored-only record ends with no token)
            reason = event.finish_reason
            if reason is None and r.stopped:  # a stop string: the engine need not go on
                engine.cancel(event.request_id)
                reason = "stop"
            if reason is not None:
                engine.forget(event.request_id)
                on_result(r, r.result(reason))
                bar.update(1)
                bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.1f} tok/s", refresh=False)
    return tokens


def as_items(records) -> list[tuple[int, Any, str | None]]:
    """check's input from JSONL text (str / bytes: a whole file) or a list whose items are
    dicts or JSON strings (one record each), numbered from 1."""
    if isinstance(records, (str, bytes)):
        return read_lines(records.encode() if isinstance(records, str) else records)
    items = []
    for n, rec in enumerate(records, 1):
        if isinstance(rec, (str, bytes)):
            try:
                items.append((n, json.loads(rec), None))
            except ValueError as e:
                items.append((n, None, f"not valid JSON: {e}"))
        else:
            items.append((n, rec, None))
    return items


def run(model: Model, records, *, max_new_tokens: int = 256, seed: int = 0, max_slots: int = 8,
        batch_invariant: bool | None = None, decode_steps: int = 4, num_draft_tokens: int = 0, on_error: str = "skip",
        tokenizer: Tokenizer | None = None, name: str | None = None, progress: bool = False,
        record_routing: bool = False) -> list[dict]:
    """Run records (a list of dicts as `dsjax batch` reads them, see dsjax.batch.records, or
    of JSON strings; or the text of a JSONL file)
    and return one output dict per record, in input order: {"id", "seed", "text", "ids",
    "finish_reason", "usage", ...}, or {"id", "error": {"line", "message"}} for a record that
    cannot run (on_error="skip"; "fail": a ValueError listing every bad record, before
    anything runs). max_new_tokens / seed: defaults for records that do not say.
    num_draft_tokens > 0: speculative decoding (the model needs its MTP layer). record_routing:
    each output also has "expert_counts" (dsjax.batch.records)."""
    return run_items(model, as_items(records), max_new_tokens=max_new_tokens, seed=seed, max_slots=max_slots,
                     batch_invariant=batch_invariant, decode_steps=decode_steps, num_draft_tokens=num_draft_tokens,
                     on_error=on_error, tokenizer=tokenizer, name=name, progress=progress,
                     record_routing=record_routing)


def run_items(model: Model, items: list[tuple[int, Any, str | None]], *, max_new_tokens: int = 256, seed: int = 0,
              max_slots: int = 8, batch_invariant: bool | None = None, decode_steps: int = 4,
              num_draft_tokens: int = 0, prefill_chunk: int = 256, capacity: int | None = None, on_error: str = "skip",
              tokenizer: Tokenizer | None = None, name: str | None = None, progress: bool = False,
              record_routing: bool = False) -> list[dict]:
    """`run` over check's items (line numbers given: one part of a larger job, as a Ray
    replica runs it; `capacity`: the whole job's engine capacity). Output dicts by line."""
    if on_error not in ("skip", "fail"):
        raise ValueError(f"on_error must be 'skip' or 'fail', got {on_error!r}")
    tokenizer = tokenizer or load_tokenizer(model)
    checked = check(model, items, tokenizer=tokenizer, name=name or model.config.name, seed=seed,
                    max_new_tokens=max_new_tokens)
    engine = make_engine(model, checked, max_slots=max_slots, batch_invariant=batch_invariant,
                         decode_steps=decode_steps, prefill_chunk=prefill_chunk, capacity=capacity,
                         num_draft_tokens=num_draft_tokens, record_routing=record_routing)
    if checked.errors and on_error == "fail":
        raise ValueError("bad records: " + "; ".join(checked.error_messages()))
    out = dict(checked.errors)
    if engine is not None:
        execute(engine, checked.records, lambda r, result: out.__setitem__(r.line, result), progress=progress)
    return [out[n] for n in sorted(out)]
