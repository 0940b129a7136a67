"""The output processor every front end shares: one request's token events -> its ids, its
text (detokenised as a stream), its stop strings and its logprob entries.

    run = TextRun(tokenizer, stop=("\\n\\n",), logprobs=True)
    for event in events:           # the engine's TokenEvents for this request
        new_text = run.take(event) # the text this event makes final
        if run.finish_reason: ...  # ended by the engine, or by a stop string (cancel the request)
    run.text, run.ids, run.logprobs, run.finish_reason, run.stop_hit

`dsjax.generate`, the server's legacy Completions API (`dsjax.protocol.completions`) and
batch jobs (`dsjax.batch.records`) all read their output through it.
"""

from __future__ import annotations

from dsjax.engine.requests import TokenEvent
from dsjax.tokenizer import Tokenizer


class TextRun:
    """One request's host-side bookkeeping: ids, logprobs, decoded text (with a tokenizer),
    stop strings. `take(event)` returns the text the event makes final: text that may still
    turn out to begin a stop string is held back until it cannot. `finish_reason` is set
    when the request ends, by the engine or by a stop string (the caller then cancels it).
    healed: the text a token-healed prompt backed off, which its first token repeats: left
    out of the text (it is the prompt's)."""

    def __init__(self, tokenizer: Tokenizer | None, stop: tuple[str, ...] = (), logprobs: bool = False,
                 healed: str = ""):
        self.tokenizer, self.stop = tokenizer, stop
        self.healed, self._head = healed, ""
        self.ids: list[int] = []
        self.logprobs: list[dict] | None = [] if logprobs else None
        self.stream = tokenizer.stream() if tokenizer is not None else None
        self.text, self.emitted = "", 0
        self.finish_reason, self.stop_hit = None, None
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def take(self, event: TokenEvent) -> str:
        if event.token is None:  # max_tokens 0 (a prompt scored only): the end, with no token
            self.finish_reason = self.finish_reason or event.finish_reason
            new, self.emitted = self.text[self.emitted:], len(self.text)
            return new
        self.ids.append(event.token)
        if self.logprobs is not None:
            entry = {"token": event.token, "logprob": event.logprob,
                     "top_logprobs": [{"token": t, "logprob": v} for t, v in (event.top_logprobs or [])]}
            if self.tokenizer is not None:
                entry["text"] = self.tokenizer.decode([event.token], skip_special_tokens=False)
            self.logprobs.append(entry)
        if self.stream is not None:
            before = len(self.text)
            self.text += self._unhealed(self.stream.push(event.token))
            self._match_stop(max(0, before - self.holdback))
        if event.finish_reason is not None and self.stop_hit is None:
            self.finish_reason = event.finish_reason
            if event.finish_reason == "stop":
                self.stop_hit = event.token
        done = self.finish_reason is not None
        end = len(self.text) if done else max(self.emitted, len(self.text) - self.holdback)
        new, self.emitted = self.text[self.emitted: end], end
        return new

    def _unhealed(self, piece: str) -> str:
        """piece, less what is left of the healed prefix (the first token's text starts with it)."""
        if len(self._head) >= len(self.healed):
            return piece
        self._head += piece
        return self._head[len(self.healed):] if len(self._head) >= len(self.healed) else ""

    def _match_stop(self, start: int) -> None:
        hits = [(self.text.find(s, start), s) for s in self.stop]
        hits = [(at, s) for at, s in hits if at >= 0]
        if hits:
            at, s = min(hits)
            self.text, self.finish_reason, self.stop_hit = self.text[:at], "stop", s
