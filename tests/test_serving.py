"""`dsjax serve` driven over HTTP by the official `openai` and `anthropic` clients (and raw
httpx for what the clients hide): outputs against dsjax.generate on deepseek-recipe's
prompt ids (greedy), usage against the engine's token counts, errors in each API's shape,
concurrency, disconnects and the queue bound read back from /metrics.

One tiny random-weights model and one compiled engine shape serve every test here (a second
server with the same shapes reuses the compiled programs)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import anthropic
import deepseek_recipe as recipe
import httpx
import numpy as np
import openai
import pytest

import dsjax
from dsjax.engine import TokenEvent
from dsjax.protocol import CHAT, MESSAGES, RESPONSES, Context, Limits, prepare
from dsjax.serving.server import BackgroundServer, build

NAME = "tiny"
SHAPES = dict(max_slots=4, capacity=512, prefill_chunk=64, max_logprobs=2)
NO_THINKING = {"thinking": {"type": "disabled"}}
# every HTTP call names its timeout: a library's default (httpx: 5 s) is not this suite's to rely on
TIMEOUT = 120


@pytest.fixture(scope="module")
def model():
    return dsjax.load_model("tiny", dtype="float32", seed=0)


@pytest.fixture(scope="module")
def served(model):
    s = build(model, name=NAME, **SHAPES, limits=Limits(max_body_bytes=64 << 10), max_thinking_tokens=6)
    srv = BackgroundServer(s.app).start()
    yield s, srv
    srv.stop()
    s.close()


@pytest.fixture(scope="module")
def guarded(model, served):
    """Same shapes (no new compile), an API key and no waiting room: the 5th request is refused."""
    s = build(model, name=NAME, **SHAPES, api_key="sekret", limits=Limits(max_waiting=0), warmup=False)
    srv = BackgroundServer(s.app).start()
    yield s, srv
    srv.stop()
    s.close()


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served[1].url, api_key="unused", max_retries=0, timeout=TIMEOUT)


def recipe_ids(body: dict) -> list[int]:
    """The oracle prompt: deepseek-recipe's own conversion + V4 encoding of the same body."""
    options = recipe.ConversionOptions().with_model_versions_by_name({NAME: recipe.ModelVersion.DeepseekV4Pro})
    conv = recipe.ChatCompletionRequest(body).convert(options)
    return recipe.DeepseekV4Encoding().with_tokenizer(dsjax.load_tokenizer().recipe).encode(conv.conversation)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    return dsjax.generate(model, [prompt], n, temperature=0.0)[0]


def text_of(ids: list[int]) -> str:
    """What the API shows of generated ids: their text, special tokens included (the recipe
    decodes them), the EOS that ends the turn left out."""
    return dsjax.load_tokenizer().decode(ids[:-1] if ids and ids[-1] == 1 else ids, skip_special_tokens=False)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def wait_idle(served, timeout=60.0):
    s, srv = served
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(srv.url, "dsjax_requests_running") == 0 and metric(srv.url, "dsjax_requests_waiting") == 0
                and all(o is None for o in s.engine.slot_owner) and not s.engine.waiting):
            return
        time.sleep(0.1)
    raise AssertionError(f"not idle after {timeout} s: running {metric(srv.url, 'dsjax_requests_running')}")


# --------------------------------------------------------------------------- outputs
def test_chat_greedy_equals_generate_on_recipe_ids(model, oai):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    r = oai.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                    extra_body=NO_THINKING)
    ids = greedy(model, recipe_ids({"model": NAME, "messages": messages, **NO_THINKING}), 12)
    assert r.choices[0].message.content == text_of(ids)
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.prompt_tokens == len(recipe_ids({"model": NAME, "messages": messages, **NO_THINKING}))
    assert r.choices[0].finish_reason == ("stop" if ids[-1] == 1 else "length")
    assert r.model == NAME and r.object == "chat.completion"


def test_max_completion_tokens_is_max_tokens(model, oai):
    """OpenAI's clients now send max_completion_tokens: it caps the answer as max_tokens does."""
    messages = [{"role": "user", "content": "Count to ten."}]
    r = oai.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=3, temperature=0,
                                    extra_body=NO_THINKING)
    ids = greedy(model, recipe_ids({"model": NAME, "messages": messages, **NO_THINKING}), 3)
    assert r.usage.completion_tokens == len(ids) <= 3 and r.choices[0].message.content == text_of(ids)


def test_count_tokens_is_the_messages_prompt(claude):
    """Anthropic's count_tokens: the length of the prompt deepseek-recipe builds for the same
    Messages body (its own conversion and V4 encoding), which is what usage reports."""
    system, messages = "Be brief.", [{"role": "user", "content": "Name a prime."}]
    n = claude.messages.count_tokens(model=NAME, system=system, messages=messages, thinking={"type": "disabled"})
    options = recipe.ConversionOptions().with_model_versions_by_name({NAME: recipe.ModelVersion.DeepseekV4Pro})
    conv = recipe.MessagesRequest({"model": NAME, "max_tokens": 1, "system": system, "messages": messages,
                                   "thinking": {"type": "disabled"}}).convert(options)
    ids = recipe.DeepseekV4Encoding().with_tokenizer(dsjax.load_tokenizer().recipe).encode(conv.conversation)
    assert n.input_tokens == len(ids) > 5
    m = claude.messages.create(model=NAME, max_tokens=1, system=system, messages=messages,
                               thinking={"type": "disabled"})
    assert m.usage.input_tokens == n.input_tokens


def test_chat_stream_equals_non_stream_and_seeds_repeat(oai):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=10, temperature=0.9, seed=1234,
              extra_body=NO_THINKING)
    whole = oai.chat.completions.create(**kw).choices[0].message.content
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole  # same seed, same tokens, streamed or not
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    other = oai.chat.completions.create(**{**kw, "seed": 4321}).choices[0].message.content
    assert other != whole  # the seed is used (10 sampled tokens of a 129k vocabulary)


def log_softmax64(model, ids: list[int]) -> np.ndarray:
    """The oracle of prompt logprobs: float64 log-softmax of the full-sequence logits [S, V]."""
    z = model.logits([ids])[0].astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_completions_echo_returns_the_prompt_logprobs(model, served, oai):
    """echo + logprobs: the prompt's tokens and logprobs (null first) before the generated
    ones, equal to the oracle; max_tokens 0 scores the prompt alone (streamed: in the first
    chunk); lm-eval's request (max_tokens 1, logprobs 1) ends with the generated token, whose
    logprob is its top one's (greedy). vLLM's prompt_logprobs: the token and the top n with
    ranks; refused (never ignored) where there is no prompt to score."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(2, 5000, 80).tolist()  # two prefill chunks of 64
    ref = log_softmax64(model, prompt)
    want = ref[np.arange(len(prompt) - 1), prompt[1:]]
    r = oai.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == dsjax.load_tokenizer().decode(prompt) and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(prompt) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=1e-5)
    assert all(len(top) == 2 and max(top.values()) >= t for top, t in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    np.testing.assert_allclose([max(top.values()) for top in lp.top_logprobs[1:]], ref[:-1].max(-1), atol=1e-5)
    chunks = list(oai.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=0, stream=True))
    assert chunks[0].choices[0].text == r.choices[0].text
    np.testing.assert_allclose(chunks[0].choices[0].logprobs.token_logprobs[1:], want, atol=1e-5)
    r = oai.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) + 1 and r.usage.completion_tokens == 1
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    np.testing.assert_allclose(lp.token_logprobs[1:-1], want, atol=1e-5)
    body = {"model": NAME, "prompt": prompt[:20], "max_tokens": 0, "prompt_logprobs": 1}
    got = httpx.post(served[1].url + "/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]
    scores = got["prompt_logprobs"]
    assert len(scores) == 20 and scores[0] is None and got["text"] == ""
    for i, (token, entry) in enumerate(zip(prompt[1:20], scores[1:])):
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(want[i], abs=1e-5)
        above = lambda margin: 1 + int((ref[i] > ref[i, token] + margin).sum())  # noqa: E731  (fp32 near-ties)
        assert above(1e-5) <= mine["rank"] <= above(-1e-5)
        best = int(ref[i].argmax())
        assert entry[str(best)]["rank"] == 1 and len(entry) == 1 + (best != token)
    bad = httpx.post(served[1].url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "model": NAME, "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
    for extra, param in (({"max_tokens": 0}, "max_tokens"), ({"echo": True, "logprobs": 5}, "logprobs"),
                         ({"prompt_logprobs": 3}, "prompt_logprobs"), ({"echo": "yes"}, "echo")):
        bad = httpx.post(served[1].url + "/v1/completions", json={"model": NAME, "prompt": prompt, **extra},
                         timeout=TIMEOUT)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (extra, bad.text)


def test_tokenizer_endpoints_as_vllm_shapes_them(served):
    """/tokenize (BOS first unless add_special_tokens is false, as a text prompt gets it),
    /detokenize, /tokenizer_info (what lm-eval's remote tokenizer reads); bad input is a 400."""
    url, tok = served[1].url, dsjax.load_tokenizer()
    r = httpx.post(url + "/tokenize", json={"prompt": "def f(x):", "return_token_strs": True}, timeout=TIMEOUT).json()
    assert r["tokens"] == [tok.bos_id] + tok.encode("def f(x):") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == SHAPES["capacity"] and "".join(r["token_strs"][1:]) == "def f(x):"
    bare = httpx.post(url + "/tokenize", json={"prompt": "def", "add_special_tokens": False}, timeout=TIMEOUT).json()
    assert bare["tokens"] == tok.encode("def") and bare["token_strs"] is None
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}], **NO_THINKING},
                      timeout=TIMEOUT).json()
    assert chat["tokens"] == recipe_ids({"model": NAME, "messages": [{"role": "user", "content": "hi"}], **NO_THINKING})
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}, timeout=TIMEOUT).json()
    assert back["prompt"] == tok.decode(r["tokens"], skip_special_tokens=False)
    info = httpx.get(url + "/tokenizer_info", timeout=TIMEOUT).json()
    assert tok.encode(info["eos_token"]) == [tok.eos_id] and tok.encode(info["bos_token"]) == [tok.bos_id]
    for path, body in (("/tokenize", {"prompt": 5}), ("/detokenize", {"tokens": [-1]}), ("/detokenize", [1])):
        bad = httpx.post(url + path, json=body, timeout=TIMEOUT)
        assert bad.status_code == 400 and "error" in bad.json()


def test_chat_at_temperature_0_is_greedy_in_thinking_mode(oai):
    """Thinking mode samples at the recipe's temperature 1.0, but an asked temperature 0 is
    greedy: two seeds, the same text (reasoning included)."""
    kw = dict(model=NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0)
    a, b = (oai.chat.completions.create(**kw, seed=seed).choices[0].message for seed in (1, 2))
    assert (a.content, getattr(a, "reasoning_content", None)) == (b.content, getattr(b, "reasoning_content", None))
    assert a.model_extra == b.model_extra


def test_seeded_sampling_is_independent_of_other_traffic(served, oai):
    """The same seed gives the same sampled tokens alone and beside three other requests."""
    kw = dict(model=NAME, messages=[{"role": "user", "content": "tell"}], max_tokens=12, temperature=1.0, seed=77,
              extra_body=NO_THINKING)
    alone = oai.chat.completions.create(**kw).choices[0].message.content
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        noise = [pool.submit(oai.chat.completions.create, **{**kw, "seed": 1000 + i,
                                                             "messages": [{"role": "user", "content": "x" * (i + 1)}]})
                 for i in range(3)]
        busy = pool.submit(oai.chat.completions.create, **kw)
        assert busy.result().choices[0].message.content == alone
        [f.result() for f in noise]


def test_chat_logprobs(oai):
    r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                    temperature=0, logprobs=True, top_logprobs=2, extra_body=NO_THINKING)
    content = r.choices[0].logprobs.content
    assert len(content) >= 1
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="at most 2 logprobs"):
        oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                    logprobs=True, top_logprobs=5, extra_body=NO_THINKING)


def test_max_logprobs_changes_no_program(model, served):
    """`--max-logprobs` only limits what requests may ask: servers built with 0 and 5 warm up
    the same programs (the same functions, static arguments and argument shapes: the served
    engine's programs report up to 20 logprobs behind a condition); a request for logprobs
    from the one with 0 is a 400 naming the flag."""
    warmed = {}
    for n in (0, 5):
        items = []
        s = build(model, name=NAME, **{**SHAPES, "max_logprobs": n}, on_warmup=lambda i, k, what: items.append(what))
        try:
            assert s.engine.logprob_width == 20 and s.engine.max_logprobs == n
            warmed[n] = (items, set(s.engine.runner.call.table))
            if n == 0:
                srv = BackgroundServer(s.app).start()
                try:
                    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
                    with pytest.raises(openai.BadRequestError, match="started without logprobs") as e:
                        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                                       max_tokens=2, logprobs=True, extra_body=NO_THINKING)
                    assert e.value.status_code == 400
                finally:
                    srv.stop()
        finally:
            s.close()
    assert warmed[0] == warmed[5] and len(warmed[0][1]) > len(warmed[0][0]) > 0  # (init_state: no warm-up item)


def test_thinking_splits_reasoning_from_content(oai):
    """Thinking mode: everything before </think> is reasoning (recipe's parser); max_tokens
    cuts this random model inside its reasoning."""
    r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                    extra_body={"thinking": {"type": "enabled"}, "seed": 40})
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning_content"] and not msg["content"]
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("api", [CHAT, RESPONSES, MESSAGES], ids=lambda a: a.name)
def test_usage_counts_tokens_cut_inside_a_character(api):
    """An answer cut by max_tokens can end in tokens that spell part of a character (a random
    model's seed-40 answer above ends in b' \\xeb\\xb0'); the recipe drops those from its count.
    Usage is the engine's count of tokens all the same, over random runs of lead, continuation
    and whole-character tokens, `</think>` among them, thinking on and off."""
    tok = dsjax.load_tokenizer()
    ctx = Context((NAME,), tok, (tok.eos_id,), 512, 2, Limits())
    byte = [tok.token_id(p) for p in ("\u00e0", "\u00e1", "\u00a1", "\u0120")]  # bytes e0, e1, a1, 20
    assert None not in byte
    pool = [*byte, *tok.encode(" Архив 饺子 x"), tok.token_id("</think>")]
    rng = np.random.default_rng(0)
    for trial in range(40):
        n = int(rng.integers(1, 8))
        ids = [int(t) for t in rng.choice(pool, n)]
        thinking = {"type": "enabled" if trial % 2 else "disabled"}
        body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "thinking": thinking}
        if api is RESPONSES:
            body = {"model": NAME, "input": "hi", "max_output_tokens": 8,
                    "reasoning": {"effort": "high" if trial % 2 else "none"}}
        job = prepare(api, body, ctx)
        translator = job.choices[0].translator
        translator.start()
        translator.push([TokenEvent("r", t, None, None, "length" if k == n - 1 else None) for k, t in enumerate(ids)])
        translator.finish("length")
        out = job.response()
        usage = (json.loads(out) if isinstance(out, str) else out)["usage"]
        assert usage["completion_tokens" if api is CHAT else "output_tokens"] == n, (ids, thinking)


def test_completions_text_ids_stop_and_batch(model, oai):
    prompt = "The capital of France is"
    expected = dsjax.generate(model, [prompt], 10, temperature=0.0, details=True)[0]
    r = oai.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
    assert r.choices[0].text == expected.text and r.usage.completion_tokens == len(expected.ids)
    ids = [0] + dsjax.load_tokenizer().encode(prompt)
    r_ids = oai.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0)
    assert r_ids.choices[0].text == expected.text and r_ids.usage.prompt_tokens == len(ids)
    stop = expected.text[3:6]  # inside the greedy text: cut before its first occurrence
    r_stop = oai.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, stop=[stop])
    assert r_stop.choices[0].text == expected.text[: expected.text.find(stop)]
    assert r_stop.choices[0].finish_reason == "stop"
    batch = oai.completions.create(model=NAME, prompt=[prompt, "1 2 3"], max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text.startswith(
        oai.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0).choices[0].text)
    chunks = list(oai.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text


def test_logit_bias_bans_and_forces_tokens(oai):
    """OpenAI's logit_bias through both clients' APIs: -100 on the greedy first token gives
    the runner-up (the raw top logprobs the same response reports), +100 forces a token."""
    messages = [{"role": "user", "content": "Name a prime."}]
    kw = dict(model=NAME, messages=messages, max_tokens=1, temperature=0, logprobs=True, top_logprobs=2,
              extra_body=NO_THINKING)
    tok = dsjax.load_tokenizer()
    top = oai.chat.completions.create(**kw).choices[0].logprobs.content[0].top_logprobs
    first = tok.encode(top[0].token)
    assert len(first) == 1
    banned = oai.chat.completions.create(**kw, logit_bias={str(first[0]): -100}).choices[0]
    assert banned.logprobs.content[0].token == top[1].token != top[0].token
    word = tok.encode(" seven")[0]
    forced = oai.completions.create(model=NAME, prompt="1 2 3", max_tokens=4, temperature=0.8, seed=3,
                                    logit_bias={str(word): 100})
    assert forced.choices[0].text == tok.decode([word] * 4) and tok.decode([word]).strip()


def test_responses_api(oai):
    chat = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       temperature=0, extra_body=NO_THINKING)
    # the Responses API says "no thinking" as reasoning effort "none"
    r = oai.responses.create(model=NAME, input="hi", max_output_tokens=8, temperature=0, reasoning={"effort": "none"})
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.output_tokens == chat.usage.completion_tokens
    events = list(oai.responses.create(model=NAME, input="hi", max_output_tokens=8, temperature=0, stream=True,
                                       reasoning={"effort": "none"}))
    assert events[0].type == "response.created"
    assert events[-1].type == ("response.incomplete" if r.status == "incomplete" else "response.completed")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text


def test_anthropic_messages(claude, oai):
    chat = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       temperature=0, extra_body=NO_THINKING)
    kw = dict(model=NAME, max_tokens=8, messages=[{"role": "user", "content": "hi"}], thinking={"type": "disabled"},
              extra_body={"temperature": 0})
    m = claude.messages.create(**kw)
    assert m.content[0].type == "text" and m.content[0].text == chat.choices[0].message.content
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.stop_reason in ("max_tokens", "end_turn")
    with claude.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == m.content[0].text and final.usage.output_tokens == m.usage.output_tokens


def test_tool_conversation_round_trip(model, oai):
    """A tool call and its result, sent back as history, are rendered by the recipe: the
    server's prompt equals recipe's ids (so the answer equals generate on them)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = oai.chat.completions.create(model=NAME, messages=messages, tools=tools, max_tokens=6, temperature=0,
                                    extra_body=NO_THINKING)
    body = {"model": NAME, "messages": messages, "tools": tools, **NO_THINKING}
    assert r.usage.prompt_tokens == len(recipe_ids(body))
    ids = greedy(model, recipe_ids(body), 6)
    assert r.choices[0].message.content == text_of(ids) or r.choices[0].message.tool_calls


# --------------------------------------------------------------------------- structured output
SCHEMA = {  # bounded (lengths, ranges, enums), so a random model finishes it within max_tokens
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "color": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "color"], "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather at a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}]


@pytest.mark.parametrize("thinking", ["disabled", "enabled"])
def test_json_schema_output_validates(oai, thinking):
    """A random-weights model writes valid JSON only because the mask makes it; in thinking
    mode the reasoning stays free (closed after the server's 6-token budget) and the answer
    validates."""
    jsonschema = pytest.importorskip("jsonschema")
    for temperature, seed, strict in ((0.0, 0, False), (1.0, 3, True)):
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": strict}}
        r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "A person as JSON."}],
                                        max_tokens=120, temperature=temperature, seed=seed, response_format=fmt,
                                        extra_body={"thinking": {"type": thinking}})
        msg = r.choices[0].message.model_dump()
        jsonschema.validate(json.loads(msg["content"]), SCHEMA)
        assert r.choices[0].finish_reason == "stop"
        assert bool(msg.get("reasoning_content")) == (thinking == "enabled")
    free = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "A person as JSON."}],
                                       max_tokens=12, temperature=0, extra_body=NO_THINKING)
    with pytest.raises(ValueError):  # the same model unconstrained: not JSON
        json.loads(free.choices[0].message.content)


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_the_grammar_is_compiled_from_the_callers_schema(api):
    """deepseek-recipe's strict schemas leave maxLength out (a 15-character name came back for
    maxLength 5); the server compiles the body's own schema, tools included."""
    from dsjax.protocol import CHAT, MESSAGES, RESPONSES, callers_constraint
    API_BY_NAME = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}
    strict = {**SCHEMA, "properties": {**SCHEMA["properties"], "name": {"type": "string", "maxLength": 5}}}
    tool = {"name": "person", "strict": True, "parameters": strict}
    body = {"chat": {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                                              "schema": strict}},
                     "messages": [{"role": "user", "content": "x"}]},
            "responses": {"text": {"format": {"type": "json_schema", "name": "p", "strict": True, "schema": strict}},
                          "input": "x"},
            "messages": {"tools": [{"name": "person", "input_schema": strict}], "max_tokens": 4,
                         "messages": [{"role": "user", "content": "x"}], **NO_THINKING}}[api]
    body["model"] = NAME
    options = recipe.ConversionOptions().with_model_versions_by_name({NAME: recipe.ModelVersion.DeepseekV4Pro})
    oc = API_BY_NAME[api].request_cls(body).convert(options).inference_options.output_constraint
    kind, schema = callers_constraint(API_BY_NAME[api], body, oc.kind, oc.schema)
    own = json.loads(schema) if api != "messages" else json.loads(schema)[0]["function"]["parameters"]
    assert own == strict and kind == oc.kind
    if api == "chat":  # tools in a Chat body, strict: their parameters as written too
        body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], **NO_THINKING,
                "tools": [{"type": "function", "function": tool}]}
        oc = recipe.ChatCompletionRequest(body).convert(options).inference_options.output_constraint
        assert "maxLength" not in oc.schema  # what the recipe hands on
        assert json.loads(callers_constraint(API_BY_NAME[api], body, oc.kind, oc.schema)[1])[0]["function"][
            "parameters"] == strict


def test_json_object_is_an_object(oai):
    """response_format json_object means a JSON object (the recipe's "any JSON value" let a
    random model answer with a bare value, which the reply parser turned into spaces)."""
    r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Reply in JSON."}],
                                    max_tokens=40, temperature=0, response_format={"type": "json_object"},
                                    extra_body=NO_THINKING)
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{"), text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_anthropic_tool_choice_any_calls_a_tool(claude):
    """tool_choice any: the answer is a tool_use block (the recipe read it as auto and a
    random model answered in text); its input validates against the tool's schema."""
    jsonschema = pytest.importorskip("jsonschema")
    fn = TOOLS[0]["function"]
    tools = [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]
    m = claude.messages.create(model=NAME, max_tokens=100, messages=[{"role": "user", "content": "Weather?"}],
                               tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True}, thinking={"type": "disabled"},
                               extra_body={"temperature": 0})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses and uses[0].name == fn["name"], m
    jsonschema.validate(uses[0].input, fn["parameters"])


def test_reasoning_budget_leaves_the_answer_tokens(guarded):
    """Thinking on + structured output, no --max-thinking-tokens (the guarded server): the
    reasoning is closed after half of max_tokens (a random model never closes it), so the
    answer validates; thinking.budget_tokens sets the budget per request."""
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=guarded[1].url + "/v1", api_key="sekret", max_retries=0, timeout=TIMEOUT)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for thinking, most in (({"type": "enabled"}, 120), ({"type": "enabled", "budget_tokens": 3}, 3)):
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "A person as JSON."}],
                                           max_tokens=240, seed=1, response_format=fmt,
                                           extra_body={"thinking": thinking})
        msg = r.choices[0].message.model_dump()
        jsonschema.validate(json.loads(msg["content"]), SCHEMA)
        # the engine stops reasoning after `most` tokens (then </think>); the recipe's count of the
        # reasoning re-reads its text, a few tokens off that on a random model's byte soup
        assert msg["reasoning_content"] and 0 < r.usage.completion_tokens_details.reasoning_tokens <= most + 5
    with pytest.raises(openai.BadRequestError, match="budget_tokens"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=10,
                                       response_format=fmt, extra_body={"thinking": {"type": "enabled",
                                                                                     "budget_tokens": 10}})


def test_tool_call_round_trip_with_strict_tools(oai):
    """tool_choice required: the answer is a DSML tool call (recipe parses it) whose
    arguments validate; the call and its result go back as history and get an answer."""
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": "Weather in Rome for 3 days?"}]
    r = oai.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_tokens=100, temperature=0, extra_body=NO_THINKING)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"  # parallel_tool_calls=False: one
    args = json.loads(calls[0].function.arguments)
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
    answer = oai.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, tool_choice="none",
                                         max_tokens=8, temperature=0, extra_body=NO_THINKING)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens >= 1


def test_bad_schema_is_a_400(served):
    url = served[1].url
    bad = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **NO_THINKING,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["message"]


# --------------------------------------------------------------------------- load, disconnects, limits
def test_32_concurrent_streams_complete(served):
    url = served[1].url

    def one(i):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
        chunks = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": f"n{i}"}],
                                                     max_tokens=6, temperature=0, stream=True, extra_body=NO_THINKING))
        return chunks[-1].choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        reasons = list(pool.map(one, range(32)))
    assert all(r in ("stop", "length") for r in reasons)
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    assert not re.search(r'dsjax_requests_total\{endpoint="chat",status="5\d\d"\}', text)
    wait_idle(served)


def test_disconnects_free_every_slot(served):
    s, srv = served
    body = {"model": NAME, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 400, "stream": True,
            "temperature": 0, **NO_THINKING}
    clients = []
    for _ in range(16):
        c = httpx.Client(timeout=60)
        resp = c.send(c.build_request("POST", srv.url + "/v1/chat/completions", json=body), stream=True)
        clients.append((c, resp))
    for c, resp in clients[:4]:  # some read a little first
        next(resp.iter_lines())
    assert metric(srv.url, "dsjax_requests_running") + metric(srv.url, "dsjax_requests_waiting") > 0
    for c, resp in clients:
        resp.close()
        c.close()
    wait_idle(served)
    assert s.engine.free_slots == list(range(SHAPES["max_slots"]))
    assert s.loop._in_flight == 0


def test_queue_full_is_429_and_the_server_recovers(guarded):
    s, srv = guarded
    headers = {"Authorization": "Bearer sekret"}
    body = {"model": NAME, "messages": [{"role": "user", "content": "long"}], "max_tokens": 400, "stream": True,
            **NO_THINKING}
    holders = []
    for _ in range(SHAPES["max_slots"]):
        c = httpx.Client(timeout=60)
        resp = c.send(c.build_request("POST", srv.url + "/v1/chat/completions", json=body, headers=headers),
                      stream=True)
        assert resp.status_code == 200
        holders.append((c, resp))
    r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": False}, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    for c, resp in holders:
        resp.close()
        c.close()
    wait_idle(guarded)
    ok = httpx.post(srv.url + "/v1/chat/completions", headers=headers, timeout=TIMEOUT,  # greedy: a sampled EOS could end it early
                    json={**body, "stream": False, "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_api_key(guarded):
    url = guarded[1].url
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **NO_THINKING}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT).status_code == 401
    bad = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"}, timeout=TIMEOUT)
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    msg = httpx.post(url + "/v1/messages", json={**body, "thinking": {"type": "disabled"}}, timeout=TIMEOUT,
                     headers={"x-api-key": "wrong"})
    assert msg.status_code == 401 and msg.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": msg.json()["error"]["message"]}}
    good = anthropic.Anthropic(base_url=url, api_key="sekret", max_retries=0, timeout=TIMEOUT).messages.create(
        model=NAME, max_tokens=1, messages=[{"role": "user", "content": "x"}], thinking={"type": "disabled"},
        extra_body={"temperature": 0})  # greedy: a sampled first token may end the turn (0 output tokens)
    assert good.usage.output_tokens == 1
    assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200  # health and metrics stay open


@pytest.mark.parametrize("path,body,status,expect", [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {"model": NAME, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
     400, "temperature"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "gpt-9"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
     400, "max_tokens"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "word " * 600}]}, 400,
     "prompt has"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]}, 400, "image"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "stop": [str(i) for i in range(20)]}, 400, "stop"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x" * (70 << 10)}]}, 413,
     "limit"),
    ("/v1/completions", {"model": NAME, "prompt": [1.5, 2]}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": [0, 10**9]}, 400, "vocab"),
    ("/v1/messages", {"model": NAME, "max_tokens": 5}, 400, "messages"),
    ("/v1/messages", {"model": NAME, "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens: required"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                              "max_completion_tokens": 4}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/messages/count_tokens", {"model": "claude-x", "messages": []}, 404, "claude-x"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "logit_bias": {"100": 500}}, 400, "[-100, 100]"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logit_bias": {"a": 5}}, 400, "not a token id"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logit_bias": {"999999999": 5}}, 400, "outside the vocab"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logit_bias": [1]}, 400, "logit_bias"),
    ("/v1/responses", {"model": NAME, "input": "x", "logit_bias": {"1": 1}}, 400, "logit_bias: not a field of the /v1/responses"),
    ("/v1/responses", {"model": NAME, "input": "x", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ("/v1/messages", {"model": "claude-x", "max_tokens": 5, "messages": []}, 404, "claude-x"),
    ("/v1/nowhere", {}, 404, "no route"),
])
def test_bad_requests_get_the_right_json_error(served, path, body, status, expect):
    url = served[1].url
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + path, **kw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    data = r.json()
    if path.startswith("/v1/messages"):
        assert data["type"] == "error" and expect in data["error"]["message"]
    else:
        assert expect in data["error"]["message"] and data["error"]["type"]
    assert httpx.get(url + "/health", timeout=TIMEOUT).json()["status"] == "ok"


def test_models_health_metrics(served, oai, claude):
    assert [m.id for m in oai.models.list().data] == [NAME]
    assert [m.id for m in claude.models.list().data] == [NAME]
    assert oai.models.retrieve(NAME).id == NAME and claude.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        oai.models.retrieve("gpt-9")
    with pytest.raises(anthropic.NotFoundError, match="claude-x"):
        claude.models.retrieve("claude-x")
    url = served[1].url
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    for name in ("dsjax_requests_running", "dsjax_requests_waiting", "dsjax_slots_used", "dsjax_prompt_tokens_total",
                 "dsjax_generation_tokens_total", "dsjax_time_to_first_token_seconds_bucket",
                 "dsjax_inter_token_latency_seconds_bucket", "dsjax_e2e_request_latency_seconds_bucket",
                 "dsjax_spec_drafts_accepted"):
        assert name in text
    assert metric(url, "dsjax_slots_total") == SHAPES["max_slots"]


def non_finite(value) -> bool:
    if isinstance(value, float):
        return not np.isfinite(value)
    if isinstance(value, dict):
        return any(non_finite(v) for v in value.values())
    return isinstance(value, list) and any(non_finite(v) for v in value)


def assert_api_error(path: str, r: httpx.Response):
    """A non-200 answer is a 4xx in its API's own error shape."""
    assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
    assert_api_error_shape(path, r)


def assert_api_error_shape(path: str, r: httpx.Response):
    data = r.json()
    if path.startswith("/v1/messages"):
        assert data["type"] == "error" and data["error"]["type"] and data["error"]["message"], data
    else:
        assert data["error"]["type"] and data["error"]["message"], data


def test_fuzzed_bodies_never_500(served):
    """hypothesis: random JSON bodies (and random values in valid-looking ones) get a 200 or
    a 4xx in the API's error shape, never a 5xx, and the server keeps serving. The test
    serialises each body itself and sends the bytes, so what reaches the server does not
    depend on an HTTP client's JSON encoder: NaN / Infinity are sent on purpose (Python's
    spelling, which RFC 8259 lacks) and must be refused as invalid JSON."""
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    url = served[1].url
    scalars = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.integers() | st.floats() | st.text(max_size=8)
    values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                          max_leaves=6)
    keys = st.sampled_from(["messages", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "tools",
                            "response_format", "prompt", "n", "logprobs", "thinking", "input", "system",
                            "logit_bias", "top_k", "store", "best_of", "stream_options", "metadata", "stop_token_ids"])
    bodies = st.fixed_dictionaries({"model": st.just(NAME), "max_tokens": st.integers(1, 3)},
                                   optional={"messages": st.just([{"role": "user", "content": "x"}])}).flatmap(
        lambda base: st.dictionaries(keys, values, max_size=3).map(lambda extra: {**base, **extra}))
    paths = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                             "/v1/messages/count_tokens"])
    chat = {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}

    with httpx.Client(timeout=TIMEOUT) as client:
        @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(path=paths, body=bodies)
        @example(path="/v1/messages", body={**chat, "messages": float("inf")})
        @example(path="/v1/chat/completions", body={**chat, "temperature": float("nan")})
        @example(path="/v1/completions", body={"model": NAME, "prompt": "x", "max_tokens": 2, "top_p": -float("inf")})
        @example(path="/v1/chat/completions", body={**chat, "seed": 2**64})
        @example(path="/v1/chat/completions", body={**chat, "seed": 2**64 - 1, "temperature": 2**63})
        @example(path="/v1/completions", body={"model": NAME, "prompt": "x", "max_tokens": 2**70})
        @example(path="/v1/messages", body={**chat, "max_tokens": -2**70})
        @example(path="/v1/responses", body={"model": NAME, "input": "x", "max_output_tokens": 2**64})
        def check(path, body):
            if isinstance(body.get("max_tokens"), int) and not 1 <= body["max_tokens"] <= 3 and abs(body["max_tokens"]) < 2**40:
                body["max_tokens"] = 2  # keep valid bodies cheap: a few tokens each (out-of-range ones must be refused)
            r = client.post(url + path, content=json.dumps(body, allow_nan=True).encode(),
                            headers={"content-type": "application/json"})
            if non_finite(body):
                assert r.status_code == 400 and "not a JSON value" in r.text, (path, body, r.text)
            if r.status_code != 200:
                assert_api_error(path, r)

        check()
        # bytes no encoder would write: cut off, not UTF-8, nested past the parser's stack (under the body limit)
        for path in ("/v1/chat/completions", "/v1/messages"):
            for raw in (b'{"model": "tiny", "messages": [', b"{\"model\": \"\xff\"}", b"[" * 10_000 + b"]" * 10_000):
                r = client.post(url + path, content=raw, headers={"content-type": "application/json"})
                assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], (path, raw[:40], r.text)
                assert_api_error(path, r)
    assert httpx.get(url + "/health", timeout=TIMEOUT).json()["status"] == "ok"
    wait_idle(served)


def test_dsjax_serve_cli_process(tmp_path):
    """`python -m dsjax.serving` in its own process: ready line, a real request; Ctrl-C with
    two streams in flight (--drain-timeout 0: stopped at once) ends each with its finish
    chunk and [DONE], then the process exits with 130."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    proc = subprocess.Popen([sys.executable, "-m", "dsjax.serving", "--dtype", "float32", "--port", str(port),
                             "--max-slots", "2", "--capacity", "256", "--prefill-chunk", "32", "--no-warmup",
                             "--drain-timeout", "0"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.25)
        r = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT).chat.completions.create(
            model="dsjax-tiny-py", messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body=NO_THINKING)
        assert r.usage.completion_tokens == 3 or r.choices[0].finish_reason == "stop"
        long = [{"role": "system", "content": "You write Python. " * 20}, {"role": "user", "content": "hi"}]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        again = [client.chat.completions.create(model="dsjax-tiny-py", messages=long, max_tokens=1,
                                                extra_body=NO_THINKING) for _ in range(2)][1]
        assert again.usage.prompt_tokens_details.cached_tokens >= 64  # the prefix cache is on by default
        lines = [[], []]
        first = [threading.Event(), threading.Event()]

        def stream(i):
            body = {"model": "dsjax-tiny-py", "prompt": f"def f{i}(x):", "max_tokens": 200, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        lines[i].append(line[6:])
                        first[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert all(e.wait(120) for e in first), "the streams did not start"
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 130
        for got in lines:  # every client got its API's ending: a finish chunk, then [DONE]
            assert got[-1] == "[DONE]", got[-3:]
            assert json.loads(got[-2])["choices"][0]["finish_reason"] in ("stop", "length"), got[-2]
        err = proc.stderr.read()
        assert "serving 'dsjax-tiny-py' on http://127.0.0.1" in err and "Traceback" not in err  # the default model
        assert re.search(r"SIGINT: draining [12] requests", err), err
        assert re.search(r"prefix cache \d+ MiB", err), err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_default_prefix_cache_needs_a_chunk_it_can_cache(model):
    """dsjax serve sizes a prefix cache by default; where the engine cannot keep blocks it
    says why and serves without one (the chunk is the block: whole compression groups)."""
    from dsjax.engine.prefix_cache import auto_options
    ratio = model.config.max_compress_ratio
    options, line = auto_options(model, max_slots=2, capacity=256, prefill_chunk=ratio + 1)
    assert options is None and f"multiple of the largest compression ratio ({ratio})" in line
    options, line = auto_options(model, max_slots=2, capacity=256, prefill_chunk=ratio, host_bytes=1 << 20)
    assert options.device_bytes >= 2**20 and options.host_bytes == 1 << 20 and "MiB" in line


def test_draining_and_a_failed_engine_answer_in_api_shape(model, served):
    """Shutdown: after drain() new requests get 503 in each API's shape and /health says
    draining. An exception inside a device step fails the request it was running with a
    5xx in API shape (a stream: an error event), /health turns 503, and nothing hangs."""
    s = build(model, name=NAME, **SHAPES, warmup=False)  # the served shapes: nothing new to compile
    srv = BackgroundServer(s.app).start()
    chat = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **NO_THINKING}
    try:
        assert s.loop.drain(0) == 0
        for path in ("/v1/chat/completions", "/v1/messages"):
            r = httpx.post(srv.url + path, json=chat, timeout=TIMEOUT)
            assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
            assert_api_error_shape(path, r)
        health = httpx.get(srv.url + "/health", timeout=TIMEOUT)
        assert health.status_code == 503 and health.json()["status"] == "draining"
    finally:
        srv.stop()
        s.close()

    s = build(model, name=NAME, **SHAPES, warmup=False)
    srv = BackgroundServer(s.app).start()

    def broken_step():
        raise RuntimeError("device program failed")
    s.engine.step = broken_step
    try:
        with httpx.stream("POST", srv.url + "/v1/messages", json={**chat, "stream": True}, timeout=TIMEOUT) as resp:
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        error = json.loads(events[-1][6:])  # Anthropic's error event ends the stream
        assert error["type"] == "error" and "device program failed" in error["error"]["message"], events
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=TIMEOUT)  # refused at once now
        assert r.status_code == 503 and "device program failed" in r.json()["error"]["message"], r.text
        assert_api_error_shape("/v1/chat/completions", r)
        health = httpx.get(srv.url + "/health", timeout=TIMEOUT)
        assert health.status_code == 503 and "device program failed" in health.json()["error"]
    finally:
        srv.stop()
        s.close()


# --------------------------------------------------------------------------- prefix cache
@pytest.fixture(scope="module")
def cached_server(model, served):
    """The same shapes with a prefix cache (compiled on first use)."""
    s = build(model, name=NAME, **SHAPES, warmup=False, prefix_cache=dsjax.PrefixCacheOptions(device_bytes=8 << 20))
    srv = BackgroundServer(s.app).start()
    yield s, srv
    srv.stop()
    s.close()


def test_usage_reports_prompt_tokens_from_the_prefix_cache(cached_server):
    """A conversation sent again (OpenAI Chat, then Anthropic Messages on the same prompt
    ids) takes its whole 64-token blocks from the prefix cache: usage says how many (OpenAI
    prompt_tokens_details.cached_tokens; Anthropic cache_read_input_tokens, input_tokens then
    counting the rest), the answer is the same, and /metrics counts the hits."""
    url = cached_server[1].url
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    messages = [{"role": "system", "content": "You answer in one word. " * 30}, {"role": "user", "content": "Hi?"}]
    kw = dict(model=NAME, messages=messages, max_tokens=4, temperature=0, extra_body=NO_THINKING)
    first, second = oai.chat.completions.create(**kw), oai.chat.completions.create(**kw)
    n = len(recipe_ids({"model": NAME, "messages": messages, **NO_THINKING}))
    assert n > 128 and first.usage.prompt_tokens == second.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details is None or not first.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 64 * 64
    assert second.choices[0].message.content == first.choices[0].message.content
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT)
    m = claude.messages.create(model=NAME, max_tokens=4, system=messages[0]["content"], messages=messages[1:],
                               thinking={"type": "disabled"}, extra_body={"temperature": 0})
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens  # Anthropic: input_tokens are the uncached ones
    assert total == n and m.usage.cache_read_input_tokens == (n - 1) // 64 * 64
    assert metric(url, "dsjax_prefix_cache_hits") >= 2 and metric(url, "dsjax_prefix_cache_prefill_tokens_saved") > 0


def test_n_samples_share_the_prefill_and_each_is_its_seeds_request(cached_server):
    """n = 4 with a seed: four choices (indices 0..3), each the answer a single request with
    seed + k gives, streamed or not; the prompt's whole blocks are prefilled once (the prefix
    cache's saved-token counter grows by 3 x its blocks), and usage counts the prompt once."""
    url = cached_server[1].url
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    messages = [{"role": "system", "content": "Samples share a prompt. " * 30}, {"role": "user", "content": "Go"}]
    kw = dict(model=NAME, messages=messages, max_tokens=6, temperature=1.0, extra_body=NO_THINKING)
    n_prompt = len(recipe_ids({"model": NAME, "messages": messages, **NO_THINKING}))
    saved = metric(url, "dsjax_prefix_cache_prefill_tokens_saved")
    r = oai.chat.completions.create(**kw, n=4, seed=11)
    assert metric(url, "dsjax_prefix_cache_prefill_tokens_saved") - saved == 3 * ((n_prompt - 1) // 64 * 64)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and len(set(texts)) == 4
    assert texts == [oai.chat.completions.create(**kw, seed=11 + k).choices[0].message.content for k in range(4)]
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 24
    chunks = list(oai.chat.completions.create(**kw, n=4, seed=11, stream=True, stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == k)
                for k in range(4)]
    assert streamed == texts and chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    assert sum(c.usage is not None for c in chunks) == 1
    done = oai.completions.create(model=NAME, prompt=["1 2", "3 4"], n=2, max_tokens=4, temperature=1.0, seed=5)
    single = [oai.completions.create(model=NAME, prompt=p, max_tokens=4, temperature=1.0, seed=5 + k).choices[0].text
              for k, p in enumerate(["1 2", "1 2", "3 4", "3 4"])]
    assert [c.index for c in done.choices] == [0, 1, 2, 3] and [c.text for c in done.choices] == single
    with pytest.raises(openai.BadRequestError, match="n: an integer in"):
        oai.chat.completions.create(**kw, n=17)
