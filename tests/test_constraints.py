"""Structured output on a random-weights model: unconstrained, `tiny` writes garbage, so an
output that parses and validates can only come from the mask. Requests go the server's way
where the recipe has one (a Chat Completions body -> deepseek-recipe's prompt ids and
`output_constraint` -> a Constraint -> the engine -> the recipe's StreamProcessor)."""

import dataclasses
import json
import re

import deepseek_recipe as recipe
import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import dsjax
from dsjax.engine import programs
from dsjax.engine.constraints import ConstraintCompiler, mask_words, pack_mask, unpack_mask
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams
from dsjax.engine.sampler import unpack_mask as device_unpack_mask
from dsjax.model import mtp_specs
from dsjax.params import init_params

MODEL_NAME = "DeepSeek-V4-Pro"  # a name the recipe maps to the V4 encoding
THINK_END = 128822
SCHEMA = {  # bounded (lengths, ranges, enums), so a random model finishes it within max_tokens
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "flags"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather at a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city", "days", "unit"], "additionalProperties": False},
        "strict": True}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Time in a zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                       "required": ["zone"], "additionalProperties": False},
        "strict": True}},
]


@pytest.fixture(scope="module")
def model():
    return dsjax.load_model("tiny", dtype="float32", seed=0)


@pytest.fixture(scope="module")
def tok():
    return dsjax.load_tokenizer()


@pytest.fixture(scope="module")
def compiler(model):
    return ConstraintCompiler.for_model(model)


@pytest.fixture(scope="module")
def engine(model):
    """One engine for the module: its programs compile once. decode_steps=2: steps without
    a constrained row run two tokens per dispatch, steps with one fall back to one."""
    eng = Engine(model, max_slots=4, capacity=512, prefill_chunk=64, decode_steps=2)
    eng.warmup(constrained=True)
    return eng


def run(engine, jobs):
    """jobs: (prompt ids, SamplingParams, Constraint | None) -> the finished Requests."""
    reqs = [engine.requests[engine.add_request(p, sp, constraint=c)] for p, sp, c in jobs]
    for _ in engine.run():
        pass
    return reqs


def chat_request(body: dict, tok):
    """A Chat Completions body as the server would take it: (conversation request, prompt ids)."""
    conv = recipe.ChatCompletionRequest({"model": MODEL_NAME, **body}).convert(recipe.ConversionOptions())
    return conv, recipe.DeepseekV4Encoding().with_tokenizer(tok.recipe).encode(conv.conversation)


def chat_response(conv, prompt_len: int, ids: list[int], tok) -> dict:
    """Generated ids through the recipe's StreamProcessor -> the accumulated Chat Completion
    (the end-of-turn EOS is not content: not pushed, as dsjax.chat does)."""
    ids = ids[:-1] if ids and ids[-1] == 1 else ids
    sp = recipe.StreamProcessor(recipe.ChatCompletionRequest.chunk_generator(conv, "test", MODEL_NAME),
                                conv.parsing_options, tok.recipe)
    events = sp.push(recipe.InferenceChunk.ready(prompt_usage=recipe.PromptUsage(prompt_tokens=prompt_len)))
    events += sp.push(recipe.InferenceChunk.tokens(ids))
    events += sp.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop)) + sp.finish()
    resp = recipe.ChatCompletionResponse("test", MODEL_NAME, 0, prompt_len, 0)
    for e in events:
        resp.accumulate(e)
    return json.loads(resp.to_json())["choices"][0]


# ---------------------------------------------------------------------------- the mask
def test_mask_packing_matches_numpy_reference(compiler, tok):
    rng = np.random.default_rng(0)
    for vocab in (129280, 1000, 37):
        allowed = rng.random((3, vocab)) < 0.3
        packed = pack_mask(allowed)
        assert packed.shape == (3, mask_words(vocab)) and packed.dtype == np.uint32
        want = np.zeros_like(packed)  # bit j of word w <=> token 32 w + j, written out by hand
        for b, t in zip(*np.nonzero(allowed)):
            want[b, t // 32] |= np.uint32(1 << (t % 32))
        np.testing.assert_array_equal(packed, want)
        np.testing.assert_array_equal(unpack_mask(packed, vocab), allowed)
        np.testing.assert_array_equal(np.asarray(jax.jit(device_unpack_mask, static_argnums=1)(
            jnp.asarray(packed), vocab)), allowed)
    # the library's packed mask == its own one-byte-per-token answer, packed by the reference
    c = compiler.compile("json_schema", SCHEMA)
    c.advance(tok.encode('{"name": "ab'))
    per_token = np.frombuffer(c._matcher.compute_logit_bias(), np.uint8)[:129280] > 0
    np.testing.assert_array_equal(c.mask(), pack_mask(per_token))
    assert 0 < per_token.sum() < 129280 and not per_token[THINK_END]


def test_masked_sampling_draws_only_allowed_tokens():
    """Greedy and sampled (temperature, top-k, top-p) rows pick allowed tokens even where the
    logits favour others; an all-ones row is the unmasked sampler bit for bit."""
    from dsjax.engine.sampler import SamplingState, sample_tokens

    rng = np.random.default_rng(1)
    B, V = 4, 4096
    logits = jnp.asarray(rng.normal(size=(B, V)) * 4, jnp.float32)
    allowed = np.ones((B, V), bool)
    allowed[:3] = rng.random((3, V)) < 0.01
    allowed[0, int(np.argmax(np.asarray(logits[0])))] = False
    s = SamplingState(jnp.asarray([0.0, 1.0, 0.7, 1.0]), jnp.asarray([0, 0, 50, 0]), jnp.asarray([1.0, 1.0, 0.9, 0.8]),
                      jnp.zeros(B), jnp.ones(B), jnp.zeros(B), jnp.zeros(B), jnp.arange(B, dtype=jnp.uint32),
                      jnp.zeros((B, 8), jnp.int32), jnp.zeros(B, jnp.int32), jnp.zeros((B, 1), jnp.int32),
                      jnp.zeros((B, 1)), jnp.zeros(B, jnp.int32))
    f = jax.jit(sample_tokens)
    for pos in range(20):
        positions = jnp.full(B, pos, jnp.int32)
        got = np.asarray(f(logits, s, positions, jnp.asarray(pack_mask(allowed))))
        assert all(allowed[b, got[b]] for b in range(B))
        assert got[0] == np.flatnonzero(allowed[0])[np.argmax(np.asarray(logits[0])[allowed[0]])]
        assert got[3] == np.asarray(f(logits, s, positions))[3]


# ---------------------------------------------------------------------------- grammars vs the recipe's formats
def test_tool_call_grammar_accepts_what_the_recipe_renders_and_nothing_malformed(compiler, tok):
    calls = [recipe.ToolCall("c1", "get_weather", json.dumps({"city": "Rome", "days": 3, "unit": "C"})),
             recipe.ToolCall("c2", "get_time", json.dumps({"zone": "CET"}))]
    defs = [recipe.ToolDefinition(t["function"]["name"], None, t["function"]["parameters"], True) for t in TOOLS]
    conv = recipe.Conversation([recipe.UserMessage("hi"), recipe.AssistantMessage("Checking.", tool_calls=calls),
                                recipe.ToolMessage("ok", "c1"), recipe.ToolMessage("ok", "c2")],
                               thinking_mode=False, tools=defs)
    rendered = recipe.DeepseekV4Encoding().render_conversation(conv).prompt
    answer = rendered.split("<｜Assistant｜></think>")[1].split("<｜end▁of▁sentence｜>")[0]
    assert "<｜DSML｜invoke" in answer

    def accepted(kind, text, prefix=""):
        c = compiler.compile(kind, TOOLS)
        for t in tok.recipe.encode(text):
            if not unpack_mask(c.mask(), 129280)[t]:
                return False
            c.advance([t])
        return bool(unpack_mask(c.mask(), 129280)[1])  # EOS: the answer is complete

    assert accepted("tool_call", answer)
    assert accepted("tool_call", "A plain answer, no call.")
    opened = answer.split("<｜DSML｜tool_calls>\n", 1)[1]  # tool_choice=required: the prompt opened the block
    assert accepted("tool_call_required", opened)
    assert not accepted("tool_call_required", "")
    assert accepted("tool_call_any", "<｜DSML｜tool_calls>\n" + opened)  # Anthropic's tool_choice any: a call
    assert not accepted("tool_call_any", answer)  # ... with no text before it
    assert not accepted("tool_call_any", "A plain answer, no call.")
    assert not accepted("tool_call", answer.replace("get_time", "get_tme"))
    assert not accepted("tool_call", answer.replace('string="false">3<', 'string="false">"3"<'))  # integer
    assert not accepted("tool_call", answer.replace(">Rome<", ">Oslo<"))  # not in the enum
    assert not accepted("tool_call", answer.replace(">CET<", ">cet<"))  # not the pattern
    no_unit = re.sub(r'<｜DSML｜parameter name="unit".*?</｜DSML｜parameter>\n', "", answer)
    assert no_unit != answer and not accepted("tool_call", no_unit)  # a required parameter missing


# ---------------------------------------------------------------------------- on the model
@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
def test_json_schema_outputs_validate(engine, compiler, tok, thinking):
    """Greedy and sampled, through the recipe both ways. Thinking on: the prompt ends in
    `<think>`; the reasoning is the model's own (the same tokens an unconstrained twin
    draws), `max_thinking_tokens` closes it, and the answer after `</think>` validates."""
    conv, prompt = chat_request({"messages": [{"role": "user", "content": "Describe a person as JSON."}],
                                 "thinking": {"type": "enabled" if thinking else "disabled"},
                                 # strict: False, as the recipe's strict normalisation drops maxLength / maxItems
                                 "response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "person", "schema": SCHEMA,
                                                                     "strict": False}}}, tok)
    oc = conv.inference_options.output_constraint
    assert oc.kind == "json" and tok.decode(prompt[-1:], skip_special_tokens=False) == (
        "<think>" if thinking else "</think>")
    budget = 6
    params = [SamplingParams(temperature=0.0, max_tokens=160, seed=1),
              SamplingParams(temperature=1.0, top_p=0.95, max_tokens=160, seed=2)]
    constraints = [compiler.compile(oc.kind, oc.schema, thinking=conv.conversation.thinking_mode,
                                    max_thinking_tokens=budget) for _ in params]
    reqs = run(engine, [(prompt, p, c) for p, c in zip(params, constraints)])
    for r, c in zip(reqs, constraints):
        assert r.finish_reason == "stop" and r.tokens[-1] == 1, tok.decode(r.tokens)
        assert c.is_finished
        choice = chat_response(conv, len(prompt), r.tokens, tok)
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        if thinking:
            assert r.tokens[budget] == THINK_END and choice["message"]["reasoning_content"]
    if thinking:  # the reasoning before </think> is exactly what the unconstrained model draws
        twins = run(engine, [(prompt, dataclasses.replace(p, max_tokens=budget), None) for p in params])
        for r, twin in zip(reqs, twins):
            assert r.tokens[:budget] == twin.tokens
    else:  # ... and unconstrained, the same requests are not JSON: the mask did it
        twins = run(engine, [(prompt, dataclasses.replace(p, max_tokens=16), None) for p in params])
        for twin in twins:
            with pytest.raises(ValueError):
                json.loads(tok.decode(twin.tokens))


def test_regex_and_choice(engine, compiler, tok):
    prompt = [0] + tok.encode("Answer:")
    regex = r"(yes|no), [0-9]{1,3} (apples|pears)\."
    choices = ["red", "green", "blue sky", "日本"]
    jobs = [(prompt, SamplingParams(temperature=t, max_tokens=40, seed=3), compiler.compile("regex", regex))
            for t in (0.0, 1.0)]
    jobs += [(p, SamplingParams(temperature=t, max_tokens=16, seed=4), compiler.compile("choice", choices))
             for p, t in ((prompt, 0.0), ([0], 1.0))]  # a one-token prompt: nothing to prefill, decode starts at once
    reqs = run(engine, jobs)
    assert all(r.finish_reason == "stop" for r in reqs)
    for r in reqs[:2]:
        assert re.fullmatch(regex, tok.decode(r.tokens)), tok.decode(r.tokens)
    for r in reqs[2:]:
        assert tok.decode(r.tokens) in choices


def test_tool_call_required_parses_into_valid_calls(engine, compiler, tok):
    """tool_choice "required": the prompt opens the DSML block, the constraint writes
    invocations; the recipe's StreamProcessor turns them into tool calls whose arguments
    validate against their tool's schema."""
    conv, prompt = chat_request({"messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": TOOLS,
                                 "tool_choice": "required", "thinking": {"type": "disabled"}}, tok)
    oc = conv.inference_options.output_constraint
    assert oc.kind == "tool_call_required"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in json.loads(oc.schema)}
    jobs = [(prompt, SamplingParams(temperature=t, max_tokens=100, seed=5), compiler.compile(oc.kind, oc.schema))
            for t in (0.0, 1.0)]
    for r in run(engine, jobs):
        assert r.finish_reason == "stop", tok.decode(r.tokens, skip_special_tokens=False)
        choice = chat_response(conv, len(prompt), r.tokens, tok)
        calls = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and calls
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_unconstrained_neighbours_unchanged(engine, compiler, tok):
    """A constrained row in the batch (which switches decoding to the split steps) leaves
    its unconstrained neighbours' tokens exactly as they are without it."""
    prompts = [[0] + tok.encode("Once upon a time"), [0] + tok.encode("The list:")]
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7), SamplingParams(max_tokens=12)]
    alone = run(engine, list(zip(prompts, params, [None, None])))
    constrained = (prompts[0], SamplingParams(max_tokens=60, seed=8), compiler.compile("json_schema", SCHEMA))
    together = run(engine, [constrained, *zip(prompts, params, [None, None])])
    assert [r.tokens for r in together[1:]] == [r.tokens for r in alone]
    assert together[0].constraint.answer_tokens  # it did run beside them


def test_constrained_serving_compiles_nothing_after_warmup(engine, compiler, tok):
    jitted = [programs.decode_forward, programs.decode_sample, programs.start_decoding, programs.decode_step,
              programs.prefill_step]
    before = [f._cache_size() for f in jitted]
    run(engine, [([0] + tok.encode("x"), SamplingParams(max_tokens=8), compiler.compile("json", "")),
                 ([0] + tok.encode("y"), SamplingParams(max_tokens=8), None)])
    assert [f._cache_size() for f in jitted] == before


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kind, schema, message", [
    ("json_schema", '{"type": "foo"}', "Invalid type: foo"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "", "a schema is required"),
    ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ("regex", "[0-9", "unclosed character class"),
    ("choice", [], "non-empty list"),
    ("choice", "yes", "list of strings"),
    ("tool_call", "[]", "non-empty list of function tools"),
    ("tool_call", [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "wat"}}}, "strict": True}}], "tool 'f', parameter 'a'"),
    ("sql", "", "unknown constraint kind 'sql'"),
])
def test_bad_constraints_raise_value_error(compiler, kind, schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compiler.compile(kind, schema)


def test_engine_refuses_what_it_cannot_constrain(engine, compiler, model):
    c = compiler.compile("json", "")
    with pytest.raises(ValueError, match="ignore_eos"):
        engine.add_request([0, 1], SamplingParams(ignore_eos=True), constraint=c)
    with pytest.raises(TypeError, match="Constraint"):
        engine.add_request([0, 1], SamplingParams(), constraint="json")
    engine.add_request([0, 5], SamplingParams(max_tokens=1), constraint=c)
    with pytest.raises(ValueError, match="one per request"):
        engine.add_request([0, 5], SamplingParams(max_tokens=1), constraint=c)
    for _ in engine.run():
        pass
    with_mtp = dsjax.Model(model.config, model.params, model.dtype, None,
                           init_params(mtp_specs(model.config, jnp.float32), 1))
    spec = Engine(with_mtp, max_slots=1, capacity=256, num_draft_tokens=1, spec_policy="fixed")
    with pytest.raises(ValueError, match="speculative decoding"):
        spec.add_request([0, 5], SamplingParams(), constraint=compiler.compile("json", ""))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_constrained_decoding_on_a_mesh_matches_one_device(engine, compiler, tok):
    """Under a mesh the masks are placed by rows like every batch-major array; the tokens
    equal one device's (greedy: the mesh's logits differ from one device's in the last bits)."""
    prompt = [0] + tok.encode("Answer:")
    regex = r"(yes|no), [0-9]{1,3} (apples|pears)\."

    def tokens(eng):
        jobs = [(prompt, SamplingParams(max_tokens=40), compiler.compile("regex", regex)),
                (prompt, SamplingParams(max_tokens=10), None)]
        return [r.tokens for r in run(eng, jobs)]

    mesh_model = dsjax.load_model("tiny", dtype="float32", mesh="data=2,tensor=2")  # rows and vocabulary split
    on_mesh = tokens(Engine(mesh_model, max_slots=2, capacity=256, prefill_chunk=16))
    assert re.fullmatch(regex, tok.decode(on_mesh[0])) and on_mesh == tokens(engine)
