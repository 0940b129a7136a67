"""A load trial of `dsjax serve`: start the server as its own process, replay a mix of
requests at several concurrency levels, and write latency, throughput, errors and server
memory to JSON (and a PNG plot when matplotlib is installed: pip install -e ".[bench]").

    python benchmarks/serve_trial.py --model tiny --concurrency 1,8,32 --max-tokens 24 \
        --out benchmarks/results/serve_trial_cpu.json --plot benchmarks/results/serve_trial_cpu.png

The mix (seeded, the same every run): short (one sentence) and long (~1500 tokens) prompts;
`shared` chats whose long system prompt is one of three the whole trial reuses (what a product's
fixed instructions look like: the prefix cache's case); `tools` chats (two function tools,
tool_choice auto); streaming and not; /v1/chat/completions with thinking disabled and enabled,
/v1/completions, /v1/messages; `cancelled` requests (a chat stream the client closes after a few chunks: counted
apart, not as errors); `structured` requests (response_format json_schema, --structured-share
of the mix): a 400 that says structured output is not supported is counted as `unsupported`,
not as an error, so the trial keeps working before and after the server gains it.

Each level is closed-loop: `concurrency` clients each send their next request when the last
one ends, --requests-per-level requests in all. Measured on the client (asyncio + httpx, in
this process; the server runs in another so the two do not share a GIL):
  ttft  request sent -> first token-bearing chunk (content or reasoning delta, completion text);
        streaming requests only (a non-streaming request's first text is its whole answer)
  itl   the gaps between successive token-bearing chunks of a stream, pooled over the level
  e2e   request sent -> last byte, every request that completed
  output tokens: the usage the server reports (chat: stream_options.include_usage; completions:
        the same; messages: message_delta.usage); tokens/s = their sum / the level's wall time
  cached: prompt tokens the server took from its prefix cache (usage), against all prompt tokens
Server RSS (psutil, the process and its children) is sampled every 0.1 s: peak and end per level.
--prefix-cache off,on runs the whole trial twice, on two servers: with the prefix cache off
(--prefix-cache-mb 0: every prompt computed, the cold case) and on (serve's default; its warm-up
requests have put the shared system prompts in it, the warm case).
After each level the trial waits for /metrics to show no running or waiting request (cancelled
streams must free their slots) and records how long that took, or that it did not happen.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import httpx
import psutil

from results_io import write_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_THINKING = {"type": "disabled"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}
SHORT = ["What is the capital of France?", "Write one sentence about the sea.", "Name three prime numbers.",
         "Explain in one line what a compiler does.", "Say hello in Spanish.", "Why is the sky blue?"]
WORDS = ("the model reads a long document about rivers mountains cities trade history weather music "
         "science markets language travel farming bridges engines ships stars numbers paper ink "
         "and then answers questions about what it has read in a short clear way").split()


def long_text(rng: random.Random, words: int) -> str:
    """Seeded filler sentences: ~1.1 tokens a word with this tokenizer, 1350 words ~1500 tokens."""
    out, sentence = [], []
    for _ in range(words):
        sentence.append(rng.choice(WORDS))
        if len(sentence) >= rng.randint(8, 16):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    return " ".join(out + [" ".join(sentence)])


# --------------------------------------------------------------------------- the mix
# (kind, weight): the kinds a level draws from; structured and cancelled shares are flags
MIX = [("chat", 3), ("chat_think", 2), ("completions", 2), ("messages", 2), ("shared", 3), ("tools", 1)]
TOOLS = [{"type": "function", "function": {"name": name, "description": what, "parameters": {
    "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
    for name, what, arg in (("get_weather", "The weather in a city", "city"),
                            ("search_docs", "Search the documentation", "query"))]


def system_prompts(words: int) -> list[str]:
    """The three long system prompts `shared` requests reuse (fixed: the same every run)."""
    return [f"You are assistant {k}. Follow these notes. " + long_text(random.Random(1000 + k), words)
            for k in range(3)]


def make_requests(n: int, args, rng: random.Random, model: str) -> list[dict]:
    kinds, weights = zip(*MIX)
    reqs = []
    for i in range(n):
        u = rng.random()
        if u < args.structured_share:
            kind = "structured"
        elif u < args.structured_share + args.cancel_share:
            kind = "cancelled"
        else:
            kind = rng.choices(kinds, weights)[0]
        long = rng.random() < args.long_share
        stream = kind == "cancelled" or rng.random() < args.stream_share
        text = (f"Request {i}. " + long_text(rng, args.long_words) + "\nSummarize the text above."
                if long else f"Request {i}. {rng.choice(SHORT)}")
        max_tokens = args.max_tokens * 4 if kind == "cancelled" else args.max_tokens
        messages = [{"role": "user", "content": text}]
        if kind == "shared":  # a long fixed system prompt, a short question: the prefix cache's case
            long, text = True, f"Request {i}. {rng.choice(SHORT)}"
            messages = [{"role": "system", "content": rng.choice(system_prompts(args.long_words))},
                        {"role": "user", "content": text}]
        if kind == "completions":
            path, body = "/v1/completions", {"prompt": text}
        elif kind == "messages":
            path, body = "/v1/messages", {"messages": messages, "thinking": NO_THINKING}
        else:
            path, body = "/v1/chat/completions", {"messages": messages,
                                                  "thinking": {"type": "enabled" if kind == "chat_think" else "disabled"}}
            if kind == "tools":
                body.update(tools=TOOLS, tool_choice="auto")
            if kind == "structured":
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA,
                                                                                  "strict": True}}
        body.update(model=model, max_tokens=max_tokens, temperature=0.7, seed=i, stream=stream)
        if stream and path != "/v1/messages":
            body["stream_options"] = {"include_usage": True}
        reqs.append({"kind": kind, "size": "long" if long else "short", "stream": stream, "path": path, "body": body})
    return reqs


# --------------------------------------------------------------------------- one request
def token_chunk(path: str, event: str | None, data: dict) -> tuple[bool, int | None, str | None]:
    """-> (carries generated text, output tokens if this chunk reports usage, finish reason)."""
    if path == "/v1/messages":
        if data.get("type") == "content_block_delta":
            d = data.get("delta") or {}
            return bool(d.get("text") or d.get("thinking")), None, None
        if data.get("type") == "message_delta":
            return False, (data.get("usage") or {}).get("output_tokens"), (data.get("delta") or {}).get("stop_reason")
        return False, None, None
    usage = (data.get("usage") or {}).get("completion_tokens")
    choices = data.get("choices") or []
    if not choices:
        return False, usage, None
    c = choices[0]
    if path == "/v1/completions":
        return bool(c.get("text")), usage, c.get("finish_reason")
    d = c.get("delta") or {}
    return bool(d.get("content") or d.get("reasoning_content")), usage, c.get("finish_reason")


def prompt_tokens(data: dict) -> int | None:
    usage = data.get("usage") or (data.get("message") or {}).get("usage") or {}
    if "input_tokens" in usage:  # Anthropic's input_tokens leave out what the cache held
        return usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0)
    return usage.get("prompt_tokens")


def cached_tokens(data: dict) -> int | None:
    usage = data.get("usage") or (data.get("message") or {}).get("usage") or {}
    if "cache_read_input_tokens" in usage:
        return usage["cache_read_input_tokens"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def unsupported(status: int, text: str) -> bool:
    return status == 400 and "not supported" in text and "structured output" in text


async def one(client: httpx.AsyncClient, url: str, req: dict, cancel_after: int) -> dict:
    r = {"kind": req["kind"], "size": req["size"], "stream": req["stream"], "status": None, "outcome": None,
         "ttft": None, "gaps": [], "e2e": None, "output_tokens": 0, "prompt_tokens": None, "chunks": 0,
         "finish": None, "cached_tokens": None}
    t0 = time.perf_counter()
    try:
        if not req["stream"]:
            resp = await client.post(url + req["path"], json=req["body"])
            r["e2e"], r["status"] = time.perf_counter() - t0, resp.status_code
            if resp.status_code != 200:
                r["outcome"] = "unsupported" if unsupported(resp.status_code, resp.text) else "error"
                r["error"] = resp.text[:300]
                return r
            data = resp.json()
            usage = data.get("usage") or {}
            r["output_tokens"] = usage.get("completion_tokens", usage.get("output_tokens", 0))
            r["prompt_tokens"], r["cached_tokens"] = prompt_tokens(data), cached_tokens(data)
            if req["path"] == "/v1/messages":
                r["finish"] = data.get("stop_reason")
            else:
                c = data["choices"][0]
                r["finish"] = c.get("finish_reason")
                if req["kind"] == "structured":
                    r["json_ok"] = valid_json((c.get("message") or {}).get("content"))
            r["outcome"] = "ok"
            return r
        async with client.stream("POST", url + req["path"], json=req["body"]) as resp:
            r["status"] = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                r["e2e"] = time.perf_counter() - t0
                r["outcome"] = "unsupported" if unsupported(resp.status_code, text) else "error"
                r["error"] = text[:300]
                return r
            event, last, content = None, None, []
            async for line in resp.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                    continue
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if event == "error" or data.get("type") == "error" or ("error" in data and "choices" not in data):
                    r["outcome"], r["error"] = "stream_error", payload[:300]
                    r["e2e"] = time.perf_counter() - t0
                    return r
                has_text, usage, finish = token_chunk(req["path"], event, data)
                r["prompt_tokens"] = prompt_tokens(data) or r["prompt_tokens"]
                r["cached_tokens"] = cached_tokens(data) or r["cached_tokens"]
                event = None
                if usage is not None:
                    r["output_tokens"] = usage
                if finish:
                    r["finish"] = finish
                if has_text:
                    now = time.perf_counter()
                    if last is None:
                        r["ttft"] = now - t0
                    else:
                        r["gaps"].append(now - last)
                    last = now
                    r["chunks"] += 1
                    if req["kind"] == "structured":
                        d = data["choices"][0].get("delta") or {}
                        content.append(d.get("content") or "")
                    if req["kind"] == "cancelled" and r["chunks"] >= cancel_after:
                        r["outcome"], r["e2e"] = "cancelled", time.perf_counter() - t0
                        return r  # leaving the block closes the connection mid-stream
            r["e2e"] = time.perf_counter() - t0
            r["outcome"] = "ok"
            if req["kind"] == "structured":
                r["json_ok"] = valid_json("".join(content))
            if req["kind"] == "cancelled":  # the stream ended before the client could cancel it
                r["outcome"] = "ended_before_cancel"
            return r
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r["outcome"], r["error"], r["e2e"] = "exception", f"{type(e).__name__}: {e}"[:300], time.perf_counter() - t0
        return r


def valid_json(text) -> bool:
    try:
        json.loads(text or "")
        return True
    except ValueError:
        return False


# --------------------------------------------------------------------------- the server process
class ServerProcess:
    def __init__(self, args):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "dsjax.serving", "--model", args.model, "--dtype", args.dtype,
                    "--port", str(self.port), *shlex.split(args.server_args)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve_trial_", suffix=".log", delete=False)
        print("starting:", shlex.join(self.cmd), "(log:", self.log.name + ")", flush=True)
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.ps = psutil.Process(self.proc.pid)

    def log_tail(self, n=20) -> str:
        with open(self.log.name) as f:
            return "".join(f.readlines()[-n:])

    def wait_ready(self, timeout: float) -> float:
        t = time.perf_counter()
        while time.perf_counter() - t < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {timeout} s:\n{self.log_tail()}")

    def rss(self) -> int:
        try:
            return sum(p.memory_info().rss for p in [self.ps, *self.ps.children(recursive=True)])
        except psutil.Error:
            return 0

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(dsjax_[a-z_]+(?:\{[^}]*\})?) ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


async def wait_idle(url: str, timeout: float) -> float | None:
    """Seconds until /metrics shows nothing running or waiting; None if it never does."""
    t = time.perf_counter()
    async with httpx.AsyncClient(timeout=10) as c:
        while time.perf_counter() - t < timeout:
            text = (await c.get(url + "/metrics")).text
            vals = dict(re.findall(r"^(dsjax_requests_(?:running|waiting)) ([0-9.eE+-]+)$", text, re.M))
            if float(vals.get("dsjax_requests_running", 1)) == 0 and float(vals.get("dsjax_requests_waiting", 1)) == 0:
                return time.perf_counter() - t
            await asyncio.sleep(0.1)
    return None


# --------------------------------------------------------------------------- one level
def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(xs) -> dict:
    return {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99), "mean": sum(xs) / len(xs) if xs else None}


async def run_level(server: ServerProcess, concurrency: int, reqs: list[dict], args) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    results, rss = [], []

    async def sampler():
        while True:
            rss.append(server.rss())
            await asyncio.sleep(0.1)

    async def worker(client):
        while not queue.empty():
            results.append(await one(client, server.url, queue.get_nowait(), args.cancel_after))

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    sampling = asyncio.create_task(sampler())
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=30), limits=limits) as client:
        t = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t
    idle_s = await wait_idle(server.url, args.idle_timeout)
    rss.append(server.rss())
    sampling.cancel()

    outcomes = collections.Counter(r["outcome"] for r in results)
    errors = collections.Counter(str(r["status"] or r["outcome"]) for r in results
                                 if r["outcome"] in ("error", "stream_error", "exception"))
    ok = [r for r in results if r["outcome"] == "ok"]
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    by_kind = collections.Counter(f'{r["kind"]}/{r["size"]}/{"stream" if r["stream"] else "whole"}' for r in results)
    structured = [r for r in results if r["kind"] == "structured"]
    level = {
        "concurrency": concurrency, "n_requests": len(results), "wall_s": wall,
        "by_kind": dict(sorted(by_kind.items())),
        "outcomes": dict(outcomes),
        "ttft_s": summary([r["ttft"] for r in results if r["ttft"] is not None and r["outcome"] == "ok"]),
        "ttft_short_s": summary([r["ttft"] for r in ok if r["ttft"] is not None and r["size"] == "short"]),
        "ttft_long_s": summary([r["ttft"] for r in ok if r["ttft"] is not None and r["size"] == "long"]),
        "itl_s": summary([g for r in results if r["outcome"] in ("ok", "cancelled") for g in r["gaps"]]),
        "e2e_s": summary([r["e2e"] for r in ok]),
        "prompt_tokens": {size: summary([r["prompt_tokens"] for r in ok if r["size"] == size and r["prompt_tokens"]])
                          for size in ("short", "long")},
        "output_tokens": out_tokens, "tokens_per_s": out_tokens / wall,
        "cached_prompt_tokens": sum(r["cached_tokens"] or 0 for r in ok),
        "all_prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "ttft_shared_s": summary([r["ttft"] for r in ok if r["ttft"] is not None and r["kind"] == "shared"]),
        "cancelled": outcomes.get("cancelled", 0), "cancelled_chunks_received": sum(
            r["chunks"] for r in results if r["outcome"] == "cancelled"),
        "ended_before_cancel": outcomes.get("ended_before_cancel", 0),
        "errors": dict(errors), "error_count": sum(errors.values()),
        "error_samples": [{"kind": r["kind"], "status": r["status"], "error": r.get("error")}
                          for r in results if r["outcome"] in ("error", "stream_error", "exception")][:5],
        "structured": {"sent": len(structured), "unsupported": sum(r["outcome"] == "unsupported" for r in structured),
                       "ok": sum(r["outcome"] == "ok" for r in structured),
                       "valid_json": sum(bool(r.get("json_ok")) for r in structured)},
        "finish_reasons": dict(collections.Counter(str(r["finish"]) for r in ok)),
        "idle_after_s": idle_s, "leaked_requests": idle_s is None,
        "server_rss_peak_mb": max(rss) / 2**20, "server_rss_end_mb": rss[-1] / 2**20,
    }
    return level


# --------------------------------------------------------------------------- report
def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed, so no plot (pip install matplotlib, or pip install -e ".[bench]");'
              " the JSON is written")
        return
    levels = result["levels"]
    c = [lv["concurrency"] for lv in levels]
    ms = lambda key, q: [(lv[key][q] or float("nan")) * 1e3 for lv in levels]  # noqa: E731
    fig, ax = plt.subplots(2, 2, figsize=(9, 6.5), dpi=80)
    for a, key, title in ((ax[0, 0], "ttft_s", "time to first token (streams)"),
                          (ax[0, 1], "itl_s", "inter-token latency")):
        a.plot(c, ms(key, "p50"), "o-", label="p50")
        a.plot(c, ms(key, "p99"), "s--", label="p99")
        a.set_title(title)
        a.set_ylabel("ms")
        a.set_yscale("log")
        a.yaxis.set_major_formatter(matplotlib.ticker.LogFormatter(labelOnlyBase=False))
        a.yaxis.set_minor_formatter(matplotlib.ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        a.legend()
    a = ax[1, 0]
    a.bar([str(x) for x in c], [lv["tokens_per_s"] for lv in levels], color="tab:green")
    for i, lv in enumerate(levels):
        a.annotate(f'{lv["tokens_per_s"]:.0f} tok/s\nerr {lv["error_count"]} canc {lv["cancelled"]}\n'
                   f'unsup {lv["structured"]["unsupported"]}', (i, lv["tokens_per_s"]), ha="center", va="top",
                   fontsize=8, xytext=(0, -4), textcoords="offset points")
    a.set_title("output tokens/s (completed requests)")
    a = ax[1, 1]
    a.plot(c, [lv["server_rss_peak_mb"] for lv in levels], "o-", label="peak")
    a.plot(c, [lv["server_rss_end_mb"] for lv in levels], "s--", label="end of level")
    a.axhline(result["server"]["rss_ready_mb"], color="gray", lw=0.8, label="after start")
    a.set_title("server RSS")
    a.set_ylabel("MiB")
    a.legend()
    for a in ax.flat:
        a.set_xlabel("concurrency")
        if a is not ax[1, 0]:
            a.set_xscale("log", base=2)
            a.set_xticks(c, [str(x) for x in c])
        a.grid(alpha=0.3)
    m = result["machine"]
    fig.suptitle(f'dsjax serve {result["args"]["model"]} ({result["args"]["dtype"]}) {result["args"]["server_args"]}'
                 f'\n{m["cpu_count"]} CPUs, load {m["loadavg_start"][0]:.1f} -> {m["loadavg_end"][0]:.1f}, '
                 f'max_tokens {result["args"]["max_tokens"]}, {m["git_commit"][:10]}', fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    print("wrote", path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="dsjax-tiny-py")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--prefix-cache", default="off,on",
                   help="a trial per mode, each its own server: off (--prefix-cache-mb 0), on (serve's default)")
    p.add_argument("--requests-per-level", type=int, default=None,
                   help="requests per level (default: 2 x concurrency, at least 8)")
    p.add_argument("--max-tokens", type=int, default=24, help="max_tokens of each request (cancelled ones: 4x)")
    p.add_argument("--server-args", default="--max-slots 16 --max-queue 128 --capacity 2048 --prefill-chunk 256",
                   help="more flags for `python -m dsjax.serving`")
    p.add_argument("--structured-share", type=float, default=0.1)
    p.add_argument("--cancel-share", type=float, default=0.1)
    p.add_argument("--cancel-after", type=int, default=3, help="token chunks a cancelled stream reads")
    p.add_argument("--long-share", type=float, default=0.25)
    p.add_argument("--long-words", type=int, default=1350, help="words of a long prompt (~1.1 tokens a word: ~1500 tokens)")
    p.add_argument("--stream-share", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--idle-timeout", type=float, default=60, help="seconds to wait for the server to go idle")
    p.add_argument("--out", default="benchmarks/results/serve_trial_cpu.json",
                   help="one JSON per --prefix-cache mode: _prefix_off / _prefix_on before the suffix")
    p.add_argument("--plot", default="benchmarks/results/serve_trial_cpu.png")
    args = p.parse_args(argv)
    modes = args.prefix_cache.split(",")
    if not set(modes) <= {"off", "on"}:
        p.error(f"--prefix-cache: off and / or on, got {args.prefix_cache!r}")
    failed = 0
    for mode in modes:
        suffix = lambda path: f"{os.path.splitext(path)[0]}_prefix_{mode}{os.path.splitext(path)[1]}"  # noqa: E731
        failed |= trial(argparse.Namespace(**{**vars(args), "prefix_cache": mode, "out": suffix(args.out),
                                              "plot": suffix(args.plot) if args.plot else None,
                                              "server_args": args.server_args + (" --prefix-cache-mb 0"
                                                                                 if mode == "off" else "")}))
    return failed


def trial(args) -> int:
    """One server, the levels in turn -> JSON (and a plot)."""
    levels = [int(x) for x in args.concurrency.split(",")]
    rng = random.Random(args.seed)

    load_start, t_start = os.getloadavg(), time.time()
    server = ServerProcess(args)
    try:
        ready_s = server.wait_ready(args.startup_timeout)
        rss_ready = server.rss()
        print(f"server ready in {ready_s:.1f} s, RSS {rss_ready / 2**20:.0f} MiB", flush=True)
        # one request of each kind first, not measured: first-use costs outside the compiled engine
        warm = make_requests(16, argparse.Namespace(**{**vars(args), "structured_share": 0, "cancel_share": 0}),
                             random.Random(-1), args.model)
        warm += [{"kind": "shared", "size": "long", "stream": False, "path": "/v1/chat/completions",
                  "body": {"model": args.model, "max_tokens": 2, "temperature": 0, "thinking": NO_THINKING,
                           "messages": [{"role": "system", "content": system},
                                        {"role": "user", "content": "Ready?"}]}}
                 for system in system_prompts(args.long_words)]  # each shared system prompt, once
        asyncio.run(run_level(server, 4, warm, args))
        results = []
        for c in levels:
            n = args.requests_per_level or max(8, 2 * c)
            level = asyncio.run(run_level(server, c, make_requests(n, args, rng, args.model), args))
            results.append(level)
            print(f"concurrency {c:>3}: {n} requests in {level['wall_s']:.1f} s, "
                  f"ttft p50 {fmt(level['ttft_s']['p50'])} p99 {fmt(level['ttft_s']['p99'])}, "
                  f"itl p50 {fmt(level['itl_s']['p50'])} p99 {fmt(level['itl_s']['p99'])}, "
                  f"{level['tokens_per_s']:.1f} tok/s, errors {level['errors'] or 0}, "
                  f"cancelled {level['cancelled']}, unsupported {level['structured']['unsupported']}, "
                  f"RSS peak {level['server_rss_peak_mb']:.0f} MiB, idle after {fmt(level['idle_after_s'], 's')}",
                  flush=True)
        final_metrics = metrics(server.url)
    finally:
        rc = server.stop()
    result = {
        "benchmark": "serve_trial", "prefix_cache": args.prefix_cache,
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "plot", "prefix_cache")},
        "server": {"command": shlex.join(server.cmd[1:]), "ready_s": ready_s, "rss_ready_mb": rss_ready / 2**20,
                   "exit_code": rc, "requests_by_status": {k[len("dsjax_requests_total"):]: v for k, v in
                                                           final_metrics.items() if k.startswith("dsjax_requests_total")},
                   "generation_tokens_total": final_metrics.get("dsjax_generation_tokens_total")},
        "machine": {"cpu_count": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "jax": metadata.version("jax"), "git_commit": git_commit(),
                    "memory_gb": psutil.virtual_memory().total / 2**30,
                    "date": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t_start)),
                    "duration_s": time.time() - t_start},
        "levels": results,
    }
    write_result(result, args.out)
    if args.plot:
        plot(result, args.plot)
    return 1 if any(lv["leaked_requests"] or any(k.startswith("5") for k in lv["errors"]) for lv in results) else 0


def fmt(x, unit="ms") -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.0f} ms" if unit == "ms" else f"{x:.1f} s"


if __name__ == "__main__":
    sys.exit(main())
