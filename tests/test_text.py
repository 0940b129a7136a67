"""The text workflow of the library: tokenizer, text prompts, stop strings and ids, input
errors that name the problem, repr(model), chat prompts, and the compile-cache setup."""

import importlib
import shutil

import deepseek_recipe as recipe
import jax
import numpy as np
import pytest

import dsjax
from dsjax import compile_cache
from dsjax.tokenizer import bundled_tokenizer_path

PROMPT = "The capital of France is"
generate_module = importlib.import_module("dsjax.generate")  # `dsjax.generate` is the function


@pytest.fixture(scope="module")
def tiny():
    return dsjax.load_model("tiny", dtype="float32")


@pytest.fixture(scope="module")
def tok():
    return dsjax.load_tokenizer()


@pytest.fixture(scope="module")
def greedy(tiny):
    """PROMPT continued greedily for 12 tokens, all details."""
    (c,) = dsjax.generate(tiny, [PROMPT], 12, details=True, ignore_eos=True)
    return c


# ----------------------------------------------------------------------------- tokenizer
def test_tokenizer_matches_the_recipe_and_round_trips(tok):
    text = "héllo 日本語 🦜, world\n\n  x"  # 🦜 is three tokens, none a whole character
    ids = tok.encode(text)
    assert ids == recipe.Tokenizer.from_file(str(bundled_tokenizer_path())).encode(text)
    assert tok.decode(ids) == text and (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == text  # BOS / EOS left out
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == text and "" in pieces  # 🦜 held until its last byte came


def test_a_checkpoints_own_tokenizer_wins(tmp_path):
    assert dsjax.load_tokenizer("tiny").path == bundled_tokenizer_path()
    assert dsjax.load_tokenizer(tmp_path).path == bundled_tokenizer_path()  # a directory without one
    shutil.copy(bundled_tokenizer_path(), tmp_path / "tokenizer.json")
    assert dsjax.load_tokenizer(tmp_path).path == (tmp_path / "tokenizer.json").resolve()
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        dsjax.load_tokenizer("no-such-dir")


# ----------------------------------------------------------------------------- generate
def test_text_in_text_out_equals_ids_in_ids_out(tiny, tok, greedy):
    ids = [tiny.config.bos_token_id] + tok.encode(PROMPT)
    assert greedy.prompt_ids == ids and greedy.usage == {"prompt_tokens": len(ids), "completion_tokens": 12}
    assert greedy.text == tok.decode(greedy.ids) and greedy.finish_reason == "length"
    for prompts in ([ids], [np.array(ids)], np.array([ids]), [tuple(ids)]):  # one prompt each: one compile
        assert dsjax.generate(tiny, prompts, 12, ignore_eos=True) == [greedy.ids]
    mixed = generate_module.plan(tiny, [PROMPT, ids, np.array([ids, ids])[1]], 12)
    assert mixed.prompts == [ids, ids, ids] and mixed.is_text == [True, False, False]


def test_heal_backs_off_the_last_token_to_every_token_extending_it(tok):
    """Tokenizer.heal: the candidates are exactly the ordinary tokens whose text begins with
    the last token's (checked against the tokenizer's own decode of every id)."""
    ids = [0] + tok.encode("def fibonacci(n):")
    h = tok.heal(ids)
    assert h.prompt == ids[:-1] and h.removed == "):" and ids[-1] in h.first_tokens
    special = set(tok._hf.get_added_tokens_decoder())
    texts = {i: tok.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size) if i not in special}
    want = {i for i, t in texts.items() if t.startswith("):") and "\ufffd" not in t}
    assert want <= set(h.first_tokens) and tok.encode("):\n")[0] in want
    assert all(texts[i].startswith("):") for i in h.first_tokens)  # a split character may follow
    assert tok.heal([0] + tok.encode("héllo 日本語")) is None  # no longer token starts with it
    assert tok.heal([0, tok.eos_id]) is None and tok.heal([0]) is None


def test_token_healing_generates_from_the_backed_off_prompt(tiny, tok):
    """generate(token_healing=True): the prompt fed is the healed one, the first token one
    of the candidates (the argmax among them, greedy), the text leaves the backed-off part
    out; id prompts are never healed."""
    prompt = "def fibonacci(n):"
    h = tok.heal([0] + tok.encode(prompt))
    (c,) = dsjax.generate(tiny, [prompt], 6, token_healing=True, ignore_eos=True, details=True)
    assert c.prompt_ids == h.prompt and c.usage["prompt_tokens"] == len(h.prompt)
    logits = tiny.logits(np.array([h.prompt]))[0, -1]
    assert c.ids[0] == h.first_tokens[int(np.argmax(logits[h.first_tokens]))]
    assert c.text == tok.decode(c.ids)[len(h.removed):]
    ids = [0] + tok.encode(prompt)
    assert dsjax.generate(tiny, [ids], 6, token_healing=True, ignore_eos=True) == \
        dsjax.generate(tiny, [ids], 6, ignore_eos=True)


def test_on_token_streams_the_text(tiny, greedy):
    seen = []
    dsjax.generate(tiny, [PROMPT], 12, ignore_eos=True, on_token=lambda i, event, text: seen.append((i, text)))
    assert len(seen) == 12 and {i for i, _ in seen} == {0} and "".join(t for _, t in seen) == greedy.text


def test_stop_string_across_tokens_cuts_and_stops(tiny, tok, greedy):
    prefix = tok.decode(greedy.ids[:4])
    stop = prefix[-2:] + greedy.text[len(prefix):][:2]  # ends token 4's text, starts token 5's
    (c,) = dsjax.generate(tiny, [PROMPT], 12, ignore_eos=True, stop=["never appears", stop], details=True)
    assert c.text == greedy.text[: greedy.text.index(stop)]
    assert c.finish_reason == "stop" and c.stop == stop
    assert c.ids == greedy.ids[: len(c.ids)] and len(c.ids) <= 5
    streamed = []
    dsjax.generate(tiny, [PROMPT], 12, ignore_eos=True, stop=stop, on_token=lambda i, e, t: streamed.append(t))
    assert "".join(streamed) == c.text  # text that might start the stop string was held back, never shown


def test_stop_token_ids(tiny, greedy):
    stop = greedy.ids[3]
    (c,) = dsjax.generate(tiny, [PROMPT], 12, stop_token_ids=[stop], details=True)
    k = greedy.ids.index(stop)
    assert c.ids == greedy.ids[: k + 1] and c.finish_reason == "stop" and c.stop == stop


@pytest.mark.parametrize("prompts, message", [
    ("hello", r"got a single string 'hello': pass \[text\] for one prompt"),
    ([0, 100, 200], r"prompts\[0\] is 0 \(int\): prompts must be a list of prompts"),
    ([[0, 1.7]], r"prompts\[0\]\[1\] is 1.7 \(float\): token ids must be ints"),
    ([[0, True]], r"prompts\[0\]\[1\] is True \(bool\): token ids must be ints"),
    ([["hello"]], r"prompts\[0\]\[0\] is 'hello' \(str\): token ids must be ints"),
    ([[]], r"prompts\[0\] is empty"),
    ([], "prompts is empty"),
    (7, "prompts must be a list of prompts .* got int"),
    (np.array([0, 100, 200]), r"shape \(3,\) \(wrap one prompt: ids\[None\]\)"),
    (np.array([[0.0, 1.7]]), "dtype float64"),
    ([None], r"prompts\[0\] is None \(NoneType\): each prompt must be a string or a list of token ids"),
])
def test_bad_prompts_are_refused_by_name(tiny, prompts, message):
    with pytest.raises(ValueError, match=message):
        dsjax.generate(tiny, prompts, 4)


@pytest.mark.parametrize("kw, message", [
    ({"max_new_tokens": True}, "max_new_tokens must be an int >= 0, got True"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an int >= 0, got 2.5"),
    ({"stop": ""}, "stop must be a non-empty string"),
    ({"stop_token_ids": [1.5]}, r"stop_token_ids: 1.5 \(float\) is not a token id"),
    ({"temperature": [0.5, 0.5]}, r"temperature: expected one value or one per prompt \(1\), got 2"),
])
def test_bad_settings_are_refused_by_name(tiny, kw, message):
    kw = {"max_new_tokens": 4, **kw}
    with pytest.raises(ValueError, match=message):
        dsjax.generate(tiny, [[0, 5]], **kw)


def test_sampling_values_reach_sampling_params_unconverted(tiny, monkeypatch):
    """SamplingParams owns the validation of sampling values: generate must not round
    top_k=2.9 to 2 or turn seed=1.5 into 1 before it looks."""
    seen = []

    class Recorder:
        def __init__(self, **kw):
            seen.append(kw)
            self.__dict__.update(kw)

    monkeypatch.setattr(generate_module, "SamplingParams", Recorder)
    generate_module.plan(tiny, [[0, 5], [0, 6]], 3, temperature=np.float32(0.5), top_k=2.9, seed=[1.5, 2],
                         min_p=0.1, repetition_penalty=1.2, presence_penalty=[0.5, -0.5], frequency_penalty=0.25)
    assert [s["top_k"] for s in seen] == [2.9, 2.9] and [s["seed"] for s in seen] == [1.5, 2]
    assert type(seen[0]["temperature"]) is np.float32 and seen[1]["presence_penalty"] == -0.5
    assert (seen[0]["min_p"], seen[0]["repetition_penalty"], seen[0]["frequency_penalty"]) == (0.1, 1.2, 0.25)


# ----------------------------------------------------------------------------- model, chat
def test_repr_is_short(tiny):
    text = repr(tiny)
    assert len(text) < 400 and len(text.splitlines()) == 5, text
    assert "'tiny'" in text and "float32" in text and "one device" in text and "reference" in text
    assert "16.99 M" in text  # count_params of the tiny config


def test_chat_thinking_mode_is_the_recipes(tiny, tok):
    chat = dsjax.Chat(tiny, tok, thinking=True, max_new_tokens=3)
    reply = chat.send("Hi")
    conv = recipe.Conversation([recipe.UserMessage("Hi")], thinking_mode=True, reasoning_effort="high")
    assert reply.prompt_ids == recipe.DeepseekV4Encoding().with_tokenizer(tok.recipe).encode(conv)
    assert reply.prompt_ids[-1] == 128821  # <think>: the answer starts in reasoning
    assert len(reply.ids) == 3 and chat.messages[-1]["role"] == "assistant"
    assert chat.messages[-1]["reasoning_content"] == reply.reasoning_content


# ----------------------------------------------------------------------------- compile cache
@pytest.fixture
def fresh_jax_cache_config(monkeypatch):
    """Run a test of setup_compile_cache as if in a new process, and put JAX back after."""
    names = ("jax_compilation_cache_dir", "jax_enable_compilation_cache", "jax_persistent_cache_min_compile_time_secs")
    saved = {n: getattr(jax.config, n) for n in names}
    monkeypatch.setattr(compile_cache, "_chosen", None)
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    yield
    for n, v in saved.items():
        jax.config.update(n, v)


def test_compile_cache_default_env_off_and_jax_config(fresh_jax_cache_config, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    c = compile_cache.setup_compile_cache()
    assert c.directory == str(tmp_path / "dsjax" / "jax") and c.source == "default" and (tmp_path / "dsjax").is_dir()
    assert jax.config.jax_compilation_cache_dir == c.directory
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0  # small CPU programs too
    assert compile_cache.setup_compile_cache() == c  # once per process: load_model calls it again
    assert compile_cache.setup_compile_cache("off").enabled is False and not jax.config.jax_enable_compilation_cache


def test_compile_cache_respects_a_dir_set_in_jax(fresh_jax_cache_config, monkeypatch, tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    c = compile_cache.setup_compile_cache()
    assert c.directory == str(tmp_path / "mine") and c.source == "jax config"
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0  # the user's settings, untouched


def test_compile_cache_env(fresh_jax_cache_config, monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.setup_compile_cache().describe() == "off (DSJAX_COMPILE_CACHE says off)"
    monkeypatch.setattr(compile_cache, "_chosen", None)
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.setup_compile_cache().directory == str(tmp_path / "env")


def test_v41_tokenizer_names_the_system_token(tmp_path):
    """DeepSeek-V4.1's prompts carry `<｜System｜>` (system messages, thinking mode): the V4
    vocabulary holds a placeholder at its id 128799, so the recipe's V4.1 encoding fails on
    the bundled file and succeeds once the V4.1 tokenizer names it; the Engram token map (a
    function of the vocabulary's text) is unchanged by the rename (spec §5.1)."""
    import json

    import deepseek_recipe as dr

    from dsjax.checkpoint.engram_tables import build_engram_token_map, engram_token_map
    from dsjax.tokenizer import SYSTEM, SYSTEM_ID

    body = {"model": "DeepSeek-V4.1-Flash", "reasoning_effort": "high",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}

    def encode(tok):
        conv = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions())
        return dr.DeepseekV41Encoding().with_tokenizer(tok.recipe).encode(conv.conversation)

    v4 = dsjax.load_tokenizer()
    with pytest.raises(Exception, match="not in the added vocabulary"):
        encode(v4)
    v41 = dsjax.load_tokenizer("tiny-v41")  # detected from the config
    assert v41.system_token and not v4.system_token and v41.token_id(SYSTEM) == SYSTEM_ID and v4.token_id(SYSTEM) is None
    ids = encode(v41)
    assert SYSTEM_ID in ids and v41.decode(ids, skip_special_tokens=False).count(SYSTEM) == ids.count(SYSTEM_ID)
    assert v41.encode("The capital of France") == v4.encode("The capital of France")
    patched = tmp_path / "tokenizer.json"
    patched.write_text(v41._json, encoding="utf-8")
    assert json.loads(patched.read_text())["added_tokens"]
    np.testing.assert_array_equal(build_engram_token_map(patched), engram_token_map())
