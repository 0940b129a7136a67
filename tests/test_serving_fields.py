"""Every row of the API field table (dsjax/protocol/field_table.py) against a live server:
refused fields are 400s naming them (their default values pass), metadata fields change no
token, unknown fields are refused, every honoured row names a test that sends the field,
and the fields read from the body reach the engine's settings and the prompt as the
recipe's own conversion builds it."""

import ast
from pathlib import Path

import anthropic
import deepseek_recipe as recipe
import httpx
import openai
import pytest

import dsjax
from dsjax.protocol.field_table import HONOURED, METADATA, REFUSED, TABLE, markdown
from dsjax.protocol import CHAT, COMPLETIONS, MESSAGES, RESPONSES, prepare
from dsjax.serving.server import BackgroundServer, build

NAME = "tiny"
TIMEOUT = 120
TESTS = Path(__file__).parent
PATHS = {CHAT.name: CHAT.path, COMPLETIONS.name: COMPLETIONS.path, RESPONSES.name: RESPONSES.path,
         MESSAGES.name: MESSAGES.path}
APIS = {a.name: a for a in (CHAT, COMPLETIONS, RESPONSES, MESSAGES)}
OFF = {"thinking": {"type": "disabled"}}
MINIMAL = {  # the smallest greedy body of each API: 2 tokens, thinking off
    CHAT.name: {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
                **OFF},
    COMPLETIONS.name: {"model": NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0},
    RESPONSES.name: {"model": NAME, "input": "hi", "max_output_tokens": 2, "temperature": 0,
                     "reasoning": {"effort": "none"}},
    MESSAGES.name: {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
                    **OFF},
}


def rows(status):
    return [(api, key, row) for api, table in TABLE.items() for key, row in sorted(table.items())
            if row.status == status]


@pytest.fixture(scope="module")
def server():
    model = dsjax.load_model("tiny", dtype="float32", seed=0)
    s = build(model, name=NAME, max_slots=4, capacity=512, prefill_chunk=64, max_logprobs=2, warmup=False)
    srv = BackgroundServer(s.app).start()
    yield s, srv
    srv.stop()
    s.close()


def post(server, api: str, body: dict) -> httpx.Response:
    return httpx.post(server[1].url + PATHS[api], json=body, timeout=TIMEOUT)


def text(api: str, data: dict) -> str:
    if api == CHAT.name:
        return data["choices"][0]["message"]["content"]
    if api == COMPLETIONS.name:
        return data["choices"][0]["text"]
    if api == RESPONSES.name:
        return "".join(c["text"] for o in data["output"] if o["type"] == "message" for c in o["content"])
    return "".join(b["text"] for b in data["content"] if b["type"] == "text")


def test_api_fields_doc_is_current():
    assert (TESTS.parent / "docs" / "api-fields.md").read_text() == markdown(), \
        "python -m dsjax.protocol > docs/api-fields.md"


def _test_sources() -> dict[str, str]:
    out = {}
    for f in TESTS.glob("test_serving*.py"):
        lines = f.read_text().splitlines()
        for node in ast.parse("\n".join(lines)).body:
            if isinstance(node, ast.FunctionDef):  # with its decorators (a parametrized test's bodies)
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                out[f"{f.name}::{node.name}"] = "\n".join(lines[first - 1: node.end_lineno])
    return out


@pytest.mark.parametrize("api,key,row", rows(HONOURED), ids=lambda x: x if isinstance(x, str) else "")
def test_every_honoured_row_names_a_test_that_sends_it(api, key, row):
    source = _test_sources().get(row.test)
    assert source is not None, f"{api}.{key}: no test {row.test}"
    sent = f"{key}=" in source or f'"{key}"' in source or (key == "stream" and ".stream(" in source)  # the SDK's
    assert sent, f"{row.test} does not send {key}"


@pytest.mark.parametrize("api,key,row", rows(REFUSED), ids=lambda x: x if isinstance(x, str) else "")
def test_refused_fields_are_400s_naming_them(server, api, key, row):
    r = post(server, api, {**MINIMAL[api], key: row.probe})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{key}: ") and row.note in message
    if api == MESSAGES.name:
        assert r.json()["type"] == "error"
    else:
        assert r.json()["error"]["param"] == key
    for benign in row.benign:  # a value that asks for nothing passes
        if benign is not None:
            assert post(server, api, {**MINIMAL[api], key: benign}).status_code == 200


def test_every_field_with_wrong_values_is_a_4xx_in_api_shape(server):
    """A sweep of malformed bodies (every field of every API's table, and unknown ones, set to
    values of the wrong type or range): each answer is a 200 or a 4xx in the API's own error
    shape, never a 5xx; at least 200 of them are refusals, and the server is healthy after."""
    refused = 0
    with httpx.Client(timeout=TIMEOUT) as client:
        for api, table in TABLE.items():
            for key in [*table, "tempreature", "guided_json"]:
                for bad in ({"x": [1, {"y": None}]}, -1, 2**62, "x" * 3, [None], 1e300):
                    r = client.post(server[1].url + PATHS[api], json={**MINIMAL[api], key: bad})
                    assert r.status_code < 500, (api, key, bad, r.text)
                    if r.status_code != 200:
                        refused += 1
                        error = r.json()["error"]
                        assert isinstance(error["message"], str) and error["message"]
                        assert (r.json()["type"] == "error") if api == MESSAGES.name else "param" in error
    assert refused >= 200
    assert httpx.get(server[1].url + "/health", timeout=TIMEOUT).json()["status"] == "ok"


def test_metadata_fields_change_no_token(server):
    for api in TABLE:
        plain = post(server, api, MINIMAL[api])
        assert plain.status_code == 200, plain.text
        for key, row in TABLE[api].items():
            if row.status == METADATA:
                r = post(server, api, {**MINIMAL[api], key: row.probe})
                assert r.status_code == 200 and text(api, r.json()) == text(api, plain.json()), (api, key, r.text)


@pytest.mark.parametrize("api", list(TABLE))
def test_unknown_fields_are_refused(server, api):
    for key in ("temprature", "chat_template_kwargs", "guided_json"):
        r = post(server, api, {**MINIMAL[api], key: 1})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{key}: not a field"), r.text


def test_sampling_fields_reach_the_engine(server):
    """The engine settings `prepare` makes of each API's sampling fields (the sampler's own
    tests check what the engine does with them)."""
    ctx = server[0].ctx
    extra = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2,
             "presence_penalty": 0.5, "frequency_penalty": -0.5}
    for api, fields in ((CHAT, extra), (COMPLETIONS, {**extra, "ignore_eos": True, "stop_token_ids": [7, 9]}),
                        (RESPONSES, {"temperature": 0.7, "top_p": 0.9, "seed": 2**40 + 3}),
                        (MESSAGES, {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 2**40 + 3})):
        params = prepare(api, {**MINIMAL[api.name], **fields}, ctx).choices[0].params
        for key, value in fields.items():
            value = value % 2**32 if key == "seed" else value  # the engine's seed: the low 32 bits
            got = getattr(params, key)
            assert (tuple(got) if key == "stop_token_ids" else got) == pytest.approx(
                tuple(value) if key == "stop_token_ids" else value), (api.name, key)
    assert prepare(CHAT, {**MINIMAL["chat"], "top_k": -1}, ctx).choices[0].params.top_k == 0  # vLLM's "off"


def _recipe_prompt(api, body: dict) -> list[int]:
    options = recipe.ConversionOptions().with_model_versions_by_name({NAME: recipe.ModelVersion.DeepseekV4Pro})
    conv = api.request_cls(body).convert(options)
    return recipe.DeepseekV4Encoding().with_tokenizer(dsjax.load_tokenizer().recipe).encode(conv.conversation)


def test_reasoning_effort_reaches_the_prompt(server):
    ctx, seen = server[0].ctx, set()
    for effort in ("low", "high", "max"):
        body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": effort}
        prompt = prepare(CHAT, body, ctx).choices[0].prompt
        assert prompt == _recipe_prompt(CHAT, body)
        seen.add(tuple(prompt))
    assert len(seen) == 3


def test_instructions_and_system_reach_the_prompt(server):
    ctx, tok = server[0].ctx, dsjax.load_tokenizer()
    said = "Answer in French."
    for api, body in ((RESPONSES, {"model": NAME, "input": "hi", "instructions": said}),
                      (MESSAGES, {"model": NAME, "max_tokens": 4, "system": said,
                                  "messages": [{"role": "user", "content": "hi"}]})):
        prompt = prepare(api, body, ctx).choices[0].prompt
        assert prompt == _recipe_prompt(api, body) and said in tok.decode(prompt)


def test_responses_tools_reach_the_prompt(server):
    ctx, tok = server[0].ctx, dsjax.load_tokenizer()
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}
    body = {"model": NAME, "input": "Weather in Paris?", "tools": [tool], "tool_choice": "required",
            "reasoning": {"effort": "none"},
            "parallel_tool_calls": False}
    choice = prepare(RESPONSES, body, ctx).choices[0]
    assert choice.prompt == _recipe_prompt(RESPONSES, body) and "get_weather" in tok.decode(choice.prompt)
    kind, schema, _thinking, parallel, _budget = choice.constraint
    assert kind == "tool_call_required" and "get_weather" in schema and parallel is False


def test_stop_strings_end_the_answer(server):
    """Chat `stop` and Messages `stop_sequences`: the answer is the unstopped greedy answer cut
    before the stop string's first occurrence, finishing as a stop."""
    url = server[1].url
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT)
    messages = [{"role": "user", "content": "Count: 1 2 3"}]
    kw = dict(model=NAME, messages=messages, max_tokens=12, temperature=0, extra_body=OFF)
    free = oai.chat.completions.create(**kw).choices[0].message.content
    stop = free[4:7]
    assert stop and len(free) > 8
    cut = oai.chat.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.message.content == free[: free.find(stop)] and cut.finish_reason == "stop"
    m = claude.messages.create(model=NAME, max_tokens=12, messages=messages, thinking={"type": "disabled"},
                               stop_sequences=[stop], extra_body={"temperature": 0})
    assert m.content[0].text == free[: free.find(stop)] and m.stop_reason == "stop_sequence"
    assert m.stop_sequence == stop
