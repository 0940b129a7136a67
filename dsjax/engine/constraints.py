"""Structured output: a grammar per request, enforced while decoding by a token mask.

    compiler = ConstraintCompiler.for_model(model)                  # once: the vocabulary (~2 s)
    c = compiler.compile("json_schema", schema, thinking=False)      # per request; ValueError: a 400
    engine.add_request(prompt_ids, params, constraint=c)

A `Constraint` wraps one llguidance matcher. Before each of its request's tokens the engine
asks it for the allowed set as a packed bitmask (`fill_mask`: ceil(V/32) uint32 words, bit j
of word w = token 32 w + j) and, once the token is read back, `advance`s it. EOS is allowed
exactly when the grammar accepts; once the grammar is complete only EOS is (the library
decides both). With `thinking=True` the grammar waits for `</think>`: the reasoning before
it is the model's own (all tokens allowed), the answer after it is constrained;
`max_thinking_tokens` bounds the reasoning (after that many tokens only `</think>` is
allowed).

Kinds (deepseek-recipe's `OutputConstraint.kind` names, plus the engine's own):
  json                schema: a JSON schema (str or dict), or "" / None for any JSON value
  json_schema         schema: a JSON schema (required)
  regex               schema: a regular expression (Rust `regex` syntax) the whole answer matches
  choice              schema: a list of strings; the answer is one of them
  tool_call           schema: the tool list (Chat Completions function tools, JSON str or list):
                      the answer is text, optionally followed by one DSML tool-call block
  tool_call_required  the same tools; the prompt has opened the block (`<｜DSML｜tool_calls>\\n`),
                      the answer is one or more invocations and the block's end
  tool_call_any       the same tools; the answer opens the block itself and calls (Anthropic's
                      tool_choice "any": no text before the call, as Anthropic's API does it)

Why llguidance (benchmarks/grammar_bench.py; figures in docs/structured-output.md): no
dependencies (a Rust wheel) where xgrammar brings torch and its import time; grammars compile
in milliseconds where xgrammar precomputes for a large fraction of a second on this 129k
vocabulary, on the request path; it reads the tokenizer's special tokens and keeps
`</think>` and the placeholders out of generated text (xgrammar finds none in this
tokenizer.json and allows `</think>` inside a JSON string); and its Lark grammars take inline
JSON schemas and regex intersection / complement, which the DSML tool-call format needs.
xgrammar's masks are faster per token, both far below a decode step, which hides them (the engine
computes masks while the device runs the forward).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Sequence

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from dsjax.tokenizer import Tokenizer, load_tokenizer

KINDS = ("json", "json_schema", "regex", "choice", "tool_call", "tool_call_required", "tool_call_any")
THINK_END = "</think>"
DSML = "｜DSML｜"  # the V4 tool-call marker (token 128825, an ordinary text token to the grammar)
# JSON between its lexemes allows at most this much whitespace: enough for indented output,
# and a model cannot fill its max_tokens with newlines inside an unfinished object.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}"}


def mask_words(vocab_size: int) -> int:
    """uint32 words of one row's packed mask."""
    return -(-vocab_size // 32)


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """Reference packing: bool [..., V] -> uint32 [..., ceil(V/32)], bit j of word w = id 32 w + j."""
    allowed = np.asarray(allowed, bool)
    pad = -allowed.shape[-1] % 32
    bits = np.pad(allowed, [(0, 0)] * (allowed.ndim - 1) + [(0, pad)])
    return np.packbits(bits, axis=-1, bitorder="little").view(np.uint32)


def unpack_mask(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Reference unpacking: uint32 [..., W] -> bool [..., V]."""
    mask = np.ascontiguousarray(mask, np.uint32)
    return np.unpackbits(mask.view(np.uint8), axis=-1, bitorder="little")[..., :vocab_size].astype(bool)


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(path: str, vocab_size: int, eos_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer.json (token trie, special tokens): ~2 s, built once."""
    return llguidance.LLTokenizer(Path(path).read_text(), n_vocab=vocab_size, eos_token=list(eos_ids))


@functools.lru_cache(maxsize=1)
def _executor() -> llguidance.LLExecutor:
    """Computes the masks of several rows in parallel (threads that release the GIL)."""
    return llguidance.LLExecutor(max(1, min(8, os.cpu_count() or 1)))


class Constraint:
    """One request's grammar and where its output stands in it. Single use: made by
    `ConstraintCompiler.compile`, given to one `Engine.add_request`."""

    def __init__(self, matcher: llguidance.LLMatcher, *, kind: str, vocab_size: int, think_end: int | None,
                 thinking: bool, max_thinking_tokens: int | None):
        self.kind, self.vocab_size, self.words = kind, vocab_size, mask_words(vocab_size)
        self._matcher, self._think_end = matcher, think_end
        self.thinking = thinking  # the request's output starts with reasoning
        self.in_answer = not thinking  # False until </think>: the grammar applies from then on
        self.max_thinking_tokens = max_thinking_tokens
        self.reasoning_tokens = 0
        self.answer_tokens: list[int] = []
        self.claimed = False  # set by the engine that serves it

    @property
    def is_finished(self) -> bool:
        """The answer is complete: the grammar allows nothing but EOS (or took it)."""
        return self.in_answer and self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The answer so far is a complete sentence of the grammar (EOS allowed now)."""
        return self.in_answer and self._matcher.is_accepting()

    def _reasoning_row(self, out: np.ndarray) -> None:
        if self.max_thinking_tokens is not None and self.reasoning_tokens >= self.max_thinking_tokens:
            out[:] = 0  # the reasoning budget is spent: close it
            out.view(np.uint32)[self._think_end // 32] = np.uint32(1 << (self._think_end % 32))
        else:
            out.view(np.int32)[:] = -1

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the allowed set of the next token into `out` (int32 or uint32 [words],
        C-contiguous): all ones while reasoning."""
        if out.shape != (self.words,) or not out.flags["C_CONTIGUOUS"] or out.dtype.itemsize != 4:
            raise ValueError(f"mask row must be a contiguous 4-byte array of shape ({self.words},), got "
                             f"{out.dtype} {out.shape}")
        if not self.in_answer:
            self._reasoning_row(out)
        else:
            self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def mask(self) -> np.ndarray:
        """The next token's allowed set, packed: uint32 [words]."""
        out = np.empty(self.words, np.uint32)
        self.fill_mask(out)
        return out

    def advance(self, tokens: Sequence[int]) -> None:
        """Move past tokens the request produced (each one the mask allowed)."""
        for token in tokens:
            token = int(token)
            if not self.in_answer:
                self.reasoning_tokens += 1
                self.in_answer = token == self._think_end
                continue
            if not self._matcher.consume_token(token):
                raise RuntimeError(f"{self.kind} constraint: token {token} after {len(self.answer_tokens)} answer "
                                   f"tokens is not allowed by the grammar ({self._matcher.get_error()}); "
                                   f"it should have been masked")
            self.answer_tokens.append(token)

    def __repr__(self) -> str:
        phase = "answer" if self.in_answer else f"reasoning ({self.reasoning_tokens} tokens)"
        return f"Constraint({self.kind}, {phase}, answer_tokens={len(self.answer_tokens)})"


def fill_masks(rows: Sequence[tuple[int, Constraint]], out: np.ndarray) -> None:
    """Masks of several rows of a batch into out (int32 [B, words], C-contiguous); the
    grammars in their answer are computed in parallel. Rows not listed are left alone."""
    parallel = []
    for row, c in rows:
        if c.in_answer:
            parallel.append((c._matcher, row))
        else:
            c.fill_mask(out[row])
    if len(parallel) == 1:
        matcher, row = parallel[0]
        llg_numpy.fill_next_token_bitmask(matcher, out, row)
    elif parallel:
        llg_numpy.fill_next_token_bitmask_par(_executor(), parallel, out)


# ---------------------------------------------------------------------------- grammars
def _first_part(message: str) -> str:
    """A library error without the grammar listing it appends (lines `   N | ...`)."""
    lines = []
    for line in message.splitlines():
        if line.lstrip()[:1].isdigit() and " | " in line:
            break
        lines.append(line.strip())
    return " ".join(x for x in lines if x)


def _lit(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)


def _schema(kind: str, schema) -> dict | bool:
    if isinstance(schema, (dict, bool)):
        return schema
    if not isinstance(schema, str):
        raise ValueError(f"{kind} constraint: the schema must be a JSON schema (a str or dict), got "
                         f"{type(schema).__name__}")
    try:
        value = json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"{kind} constraint: the schema is not valid JSON ({e})") from None
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"{kind} constraint: a JSON schema is an object (or true / false), got {schema[:80]!r}")
    return value


def _json_options(schema, lenient: bool = False):
    """The schema with the engine's JSON layout (and leniency) as llguidance's x-guidance."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    return {**schema, "x-guidance": {**JSON_OPTIONS, **({"lenient": True} if lenient else {}),
                                     **schema.get("x-guidance", {})}}


def _tools(kind: str, schema) -> list[dict]:
    tools = schema
    if isinstance(schema, str):
        try:
            tools = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{kind} constraint: the tool list is not valid JSON ({e})") from None
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{kind} constraint: expected a non-empty list of function tools, got {str(schema)[:80]!r}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"{kind} constraint: tools[{i}] is not an object")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{kind} constraint: tools[{i}] has type {tool.get('type')!r}; only function tools "
                             f"can be called")
        fn = tool.get("function", tool)
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name or '"' in name or DSML in name:
            raise ValueError(f"{kind} constraint: tools[{i}] needs a function name (a non-empty string without "
                             f"'\"'), got {name!r}")
        params = fn.get("parameters")
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise ValueError(f"{kind} constraint: tools[{i}] ({name}): parameters must be a JSON schema object")
        out.append({"name": name, "parameters": params, "strict": bool(fn.get("strict"))})
    return out


_ANNOTATIONS = {"type", "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                "writeOnly"}
_CLOSE_RE = f"<\\/{DSML}parameter>\\n"  # a parameter's close tag, in a Lark regex
_ANY = "(.|\\n)*"
_ONE_DSML = f"~/{_ANY}{DSML}{_ANY}{DSML}{_ANY}/"  # with the close tag's own: the value holds no DSML marker
# A raw (string="true") value is text up to and including the parameter's close tag, as ONE
# lexeme: a value lexeme followed by a literal tag would end at its longest match and swallow
# the tag's "<". RAW_VALUE: any text without the DSML marker.
_RAW_VALUE = f"/{_ANY}{_CLOSE_RE}/ & {_ONE_DSML}"
_TEXT = f"/{_ANY}/ & ~/{_ANY}{DSML}{_ANY}/"  # an answer's text: anything but DSML markup
_OPEN = f"/{_ANY}<{DSML}tool_calls>\\n/ & {_ONE_DSML}"  # text, then the block opens


def _raw_forms(schema, terminal: str) -> tuple[list[str], list[str]]:
    """How a parameter may be written raw (string="true": the text is the string): Lark
    alternatives for its value + close tag, and the terminals they need. Plain strings: any
    text; string enums / consts: those texts; strings with min/maxLength and / or an anchored
    pattern: text matching them. Anything else (other types, formats, unanchored patterns)
    is written as JSON only -> ([], [])."""
    if not isinstance(schema, dict):
        return [], []
    keys = set(schema) - _ANNOTATIONS
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        if keys <= {"enum", "const"} and schema.get("type", "string") == "string" and values \
                and all(isinstance(v, str) and DSML not in v for v in values):
            return [_lit(v + f"</{DSML}parameter>\n") for v in values], []
        return [], []
    if schema.get("type") != "string" or not keys <= {"minLength", "maxLength", "pattern"}:
        return [], []
    if not keys:
        return ["RAW_VALUE"], []
    parts = []
    if "minLength" in keys or "maxLength" in keys:
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        parts.append(f"/(.|\\n){{{lo},{'' if hi is None else int(hi)}}}{_CLOSE_RE}/")
    if "pattern" in keys:
        pattern = schema["pattern"]
        if not (isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$")
                and not pattern.endswith("\\$")):
            return [], []  # JSON Schema patterns match anywhere: leave those to the JSON form
        body = pattern[1:-1].replace("/", "\\/")  # a slash would end the Lark regex
        parts.append(f"/(?:{body}){_CLOSE_RE}/")
    return [terminal], [f"{terminal}: {' & '.join(parts)} & {_ONE_DSML}"]


def _parameter_rules(t: int, tool: dict) -> tuple[str, list[str]]:
    """The DSML parameters of tool t, as deepseek-recipe renders and parses them:
    `<｜DSML｜parameter name="p" string="true">raw text</｜DSML｜parameter>` for strings,
    `... string="false">JSON</｜DSML｜parameter>` for any value, one a line. Declared
    properties come in schema order, the required ones mandatory, each value valid against
    its property's schema (strict tools: every keyword; others leniently: keywords the
    library lacks are ignored). Strings may be raw (what the model is taught) or JSON;
    other values are JSON. -> (expression, rules)."""
    params, strict = tool["parameters"], tool["strict"]
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    close = _lit(f"</{DSML}parameter>\n")
    as_raw, as_json = '" string="true">', '" string="false">'
    props = params.get("properties")
    if not isinstance(props, dict):  # no declared properties: any names, any JSON values (unless closed)
        if params.get("additionalProperties") is False:
            return "", []
        head, any_json = _lit(f'<{DSML}parameter name="'), json.dumps(_json_options({}, lenient=True))
        rule = (f"param_{t}: {head} PARAM_NAME {_lit(as_raw)} RAW_VALUE"
                f" | {head} PARAM_NAME {_lit(as_json)} %json {any_json} {close}")
        return f"param_{t}*", [rule]
    required = params.get("required") if isinstance(params.get("required"), list) else []
    parts, rules = [], []
    for j, (name, sub) in enumerate(props.items()):
        if '"' in name or DSML in name:
            raise ValueError(f"tool {tool['name']!r}: parameter name {name!r} cannot be written in DSML")
        head = f'<{DSML}parameter name="{name}'
        sub_schema = _json_options({**defs, **sub} if isinstance(sub, dict) else sub, lenient=not strict)
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(sub_schema))
        if error and not error.startswith("WARNING"):
            raise ValueError(f"tool {tool['name']!r}, parameter {name!r}: {_first_part(error)}")
        raw, terminals = _raw_forms(sub, f"RAW_{t}_{j}")
        alts = [f"{_lit(head + as_raw)} {r}" for r in raw]
        alts.append(f"{_lit(head + as_json)} %json {json.dumps(sub_schema)} {close}")
        rules += [f"p_{t}_{j}: " + " | ".join(alts), *terminals]
        parts.append(f"p_{t}_{j}" + ("" if name in required else "?"))
    return " ".join(parts), rules


def tool_call_grammar(tools: list[dict], required: bool, parallel: bool = True, must_open: bool = False) -> str:
    """Lark grammar of a V4 answer that calls `tools` in DSML. required=False: text, then
    optionally one tool-call block (must_open=True: no text, the answer opens the block);
    required=True: the prompt opened the block, the answer is one or more invocations
    (exactly one with parallel=False) and the block's end."""
    rules, invokes = [], []
    for t, tool in enumerate(tools):
        params, param_rules = _parameter_rules(t, tool)
        rules += param_rules
        head, tail = _lit(f'<{DSML}invoke name="{tool["name"]}">\n'), _lit(f"</{DSML}invoke>\n")
        rules.append(f"invoke_{t}: {head} {params} {tail}")
        invokes.append(f"invoke_{t}")
    calls = f"({' | '.join(invokes)}){'+' if parallel else ''} {_lit(f'</{DSML}tool_calls>')}"
    start = [f"start: {calls}"] if required else [f"start: {_lit(f'<{DSML}tool_calls>')} {_lit(chr(10))} {calls}"] \
        if must_open else [f"start: TEXT | OPEN {calls}", f"TEXT: {_TEXT}", f"OPEN: {_OPEN}"]
    return "\n".join([*start, *rules, f"RAW_VALUE: {_RAW_VALUE}", "PARAM_NAME: /[A-Za-z0-9_.\\-]+/"]) + "\n"


def grammar_for(kind: str, schema, parallel_tool_calls: bool = True) -> str:
    """llguidance grammar (its JSON form) of one constraint. Raises ValueError for an unknown
    kind or a schema of the wrong type; the grammar itself is checked at compile.
    parallel_tool_calls=False: a tool-call block holds one invocation (the APIs' switch)."""
    M = llguidance.LLMatcher
    if kind not in KINDS:
        raise ValueError(f"unknown constraint kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind in ("json", "json_schema"):
        if schema in (None, "") and kind == "json":
            schema = {}
        elif schema in (None, ""):
            raise ValueError("json_schema constraint: a schema is required")
        return M.grammar_from_json_schema(_json_options(_schema(kind, schema)))
    if kind == "regex":
        if not isinstance(schema, str) or not schema:
            raise ValueError(f"regex constraint: expected a non-empty regular expression, got {schema!r}")
        return M.grammar_from_regex(schema)
    if kind == "choice":
        if isinstance(schema, str):
            raise ValueError("choice constraint: expected a list of strings, got a str")
        choices = list(schema) if isinstance(schema, (list, tuple)) else None
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"choice constraint: expected a non-empty list of non-empty strings, got {schema!r}")
        return M.grammar_from_lark("start: " + " | ".join(_lit(c) for c in choices) + "\n")
    tools = _tools(kind, schema)
    try:
        lark = tool_call_grammar(tools, required=kind == "tool_call_required", parallel=parallel_tool_calls,
                                 must_open=kind == "tool_call_any")
    except ValueError as e:
        raise ValueError(f"{kind} constraint: {e}") from None
    return M.grammar_from_lark(lark)


class ConstraintCompiler:
    """A vocabulary as the grammar library sees it (built once per tokenizer file, vocabulary
    size and EOS ids: ~2 s) and `compile(kind, schema)` -> a fresh `Constraint` (~ms)."""

    def __init__(self, tokenizer: Tokenizer | str | Path | None = None, *, vocab_size: int,
                 eos_ids: Sequence[int] = (1,)):
        tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        self.vocab_size, self.eos_ids = int(vocab_size), tuple(int(i) for i in eos_ids)
        self.words = mask_words(self.vocab_size)
        self.think_end = tokenizer.token_id(THINK_END)
        self._tokenizer = _ll_tokenizer(str(tokenizer.path.resolve()), self.vocab_size, self.eos_ids)

    @classmethod
    def for_model(cls, model, tokenizer: Tokenizer | str | Path | None = None) -> "ConstraintCompiler":
        """For a `dsjax.Model` (its vocabulary size and EOS ids), with its tokenizer (default:
        the bundled V4 tokenizer; pass a checkpoint's own)."""
        cfg = model.config
        return cls(tokenizer if tokenizer is not None else load_tokenizer(model), vocab_size=cfg.vocab_size,
                   eos_ids=cfg.eos_token_ids)

    def compile(self, kind: str, schema=None, *, thinking: bool = False, max_thinking_tokens: int | None = None,
                parallel_tool_calls: bool = True) -> Constraint:
        """A Constraint for one request. thinking: the output starts with reasoning, which
        the constraint leaves alone until `</think>`. parallel_tool_calls=False: at most one
        tool call. Raises ValueError naming the problem (unknown kind, schema that is not
        JSON, unsupported schema keyword, bad regex)."""
        grammar = grammar_for(kind, schema, parallel_tool_calls)
        if thinking and self.think_end is None:
            raise ValueError(f"thinking=True needs a {THINK_END} token, which this tokenizer does not have")
        if max_thinking_tokens is not None and not (isinstance(max_thinking_tokens, int) and max_thinking_tokens >= 0):
            raise ValueError(f"max_thinking_tokens must be an int >= 0 or None, got {max_thinking_tokens!r}")
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise ValueError(f"{kind} constraint: {_first_part(messages[0])}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{kind} constraint: {_first_part(matcher.get_error())}")
        return Constraint(matcher, kind=kind, vocab_size=self.vocab_size, think_end=self.think_end,
                          thinking=bool(thinking), max_thinking_tokens=max_thinking_tokens)
