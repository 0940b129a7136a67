"""Capture in the engine: named points of the forward (dsjax.inspect's names) recorded for
every token the engine computes, read back with its events (docs/inspect.md, "In the engine").

    engine = Engine(model, capture=("layers.*.moe.experts", "layers.*.moe.weights"))
    engine.add_request(prompt, SamplingParams(max_tokens=8, capture=True))
    event.capture["layers.3.moe.experts"]        # [K] int32: the experts of the step that made this token
    first_event.prompt_capture["layers.3.moe.experts"]   # [P - 1, K]: each prompt position before the last

What programs compute is the engine's (`Engine(capture=patterns)`, resolved here once to full
names, a static argument of its programs); a request asks to receive it (`SamplingParams.capture`),
as `logprobs` asks for what `max_logprobs` computes. A token's values are those of the forward
step whose logits it was sampled from: position len(prompt) + i - 1 for generated token i (the
first token's: the prompt's last position). Together with the prompt's positions before the
last they cover every position the engine computed for the request, each once: what a full
forward of prompt + tokens[:-1] records (tests/test_engine_capture.py holds them equal).

`expert_counts` turns routing into per-layer per-expert token counts (expert load), which
`dsjax batch --record-routing` writes per record.
"""

from __future__ import annotations

import fnmatch
import re

import numpy as np

from dsjax.model.interface import describe_points

ROUTING = ("layers.*.moe.experts",)  # what expert-load counting captures


def resolve(patterns, points: dict[str, tuple]) -> tuple[str, ...]:
    """Capture patterns (a name, or fnmatch patterns such as "layers.*.moe.experts") -> the full
    names they match among `points` (`capture_points`: the engine's per-token points), layers
    in order. Each pattern must match some point: the error lists them."""
    patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"capture must be a name or a sequence of names / fnmatch patterns, got {patterns!r}")
    unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in points)]
    if unknown:
        raise ValueError(f"capture {unknown} matches no point the engine can capture per token; they are:\n"
                         f"{describe_points(points)}\n(dsjax.inspect.forward captures the rest, e.g. indexer.scores, "
                         f"over a whole sequence)")
    names = {n for n in points for p in patterns if fnmatch.fnmatchcase(n, p)}
    return tuple(sorted(names, key=_order))


def _order(name: str):
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    return (int(m.group(1)), m.group(2)) if m else (-1, name)


def expert_counts(trace: dict[str, np.ndarray], n_layers: int, n_experts: int) -> np.ndarray:
    """Tokens each layer routed to each expert: [n_layers, n_experts] int64 from a trace's
    `layers.{i}.moe.experts` ([..., K] each; layers not in it count nothing)."""
    counts = np.zeros((n_layers, n_experts), np.int64)
    for name, experts in trace.items():
        m = re.fullmatch(r"layers\.(\d+)\.moe\.experts", name)
        if m is not None:
            counts[int(m.group(1))] += np.bincount(np.asarray(experts).reshape(-1), minlength=n_experts)
    return counts
