"""The CLI runs the bundled default model (dsjax-tiny-py) with the shipped tokenizer.

Subprocesses (each pays JAX's start-up and, cold, ~15 s of compiling) only where a process
boundary is the point: the compile cache across processes, Ctrl-C, the console entry.
Everything else calls `dsjax.cli.main` in this process and reads capsys."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import deepseek_recipe as recipe
import pytest

import dsjax
from dsjax import cli
from dsjax.kernels import cpu as cpu_kernels
from dsjax.tokenizer import bundled_tokenizer_path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Hello, world"


def _env(cache_dir) -> dict:
    """This checkout's dsjax (not an installed one) and a compile cache of the test's own."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "DSJAX_COMPILE_CACHE": str(cache_dir)}


def _run(*args, cache_dir):
    return subprocess.run([sys.executable, "-m", "dsjax.cli", *args], capture_output=True, text=True, timeout=600,
                          env=_env(cache_dir))


def _entries(cache_dir) -> int:
    return sum(1 for _ in Path(cache_dir).glob("*-cache"))


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("compile_cache")


@pytest.fixture(scope="module")
def cold_then_warm(shared_cache):
    """The same generation in two processes over one fresh compile cache: (cold, entries
    after it, warm, entries after it)."""
    args = (PROMPT, "--max-new-tokens", "5", "--seed", "3", "--temperature", "0.9")
    cold = _run("generate", *args, "--ids", cache_dir=shared_cache)
    written = _entries(shared_cache)
    warm = _run("generate", *args, cache_dir=shared_cache)
    return cold, written, warm, _entries(shared_cache)


def test_generate_matches_library_call(cold_then_warm):
    out, _, text, _ = cold_then_warm
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    tok = dsjax.load_tokenizer()
    healed = tok.heal([0] + tok.encode(PROMPT))  # the CLI heals text prompts: " world" backed off
    assert healed is not None and result["prompt_ids"] == healed.prompt
    model = dsjax.load_model()  # the CLI's default model and dtype
    (expected,) = dsjax.generate(model, [PROMPT], 5, temperature=0.9, seed=3, token_healing=True, details=True)
    assert result["new_ids"] == expected.ids and expected.ids[0] in healed.first_tokens
    assert text.returncode == 0, text.stderr
    assert text.stdout.rstrip("\n") == expected.text  # streamed piece by piece, the same text
    assert tok.decode(expected.ids).startswith(healed.removed)
    assert expected.text == tok.decode(expected.ids)[len(healed.removed):]


def test_second_process_reads_the_compile_cache(cold_then_warm):
    cold, written, warm, after = cold_then_warm
    assert written > 0, cold.stderr
    assert after == written, "the warm run compiled (and wrote) programs the cold run had cached"
    line = next(s for s in warm.stderr.splitlines() if "read from the compile cache" in s)
    assert " 0 compiled" in line and not line.split("programs: ")[1].startswith("0 "), line
    assert "compiling (programs compiled before are read from the cache in" in cold.stderr and "loading dsjax-tiny-py (trained weights" in cold.stderr


def test_params_json(capsys):
    assert cli.main(["params", "--config", "v4-flash", "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)
    from dsjax.param_count import count_params
    assert counts["total"] == count_params(dsjax.load_config("v4-flash"))["total"]


def test_errors_name_the_problem(capsys):
    assert cli.main(["generate", "x", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "named configs" in err


@pytest.mark.parametrize("argv, message", [
    (["cache", "--context", "0"], "--context: context lengths must be positive integers, got '0'"),
    (["cache", "--context", "-16"], "--context: context lengths must be positive integers, got '-16'"),
    (["cache", "--context", "8192,lots"], "got 'lots'"),
    (["memory", "--mesh", "expert=7"], "mesh expert=7 does not divide n_routed_experts=256"),
    (["memory", "--mesh", "expert=two"], "expected comma-separated axis=size"),
    (["generate", "x", "--top-k", "2.9"], "argument --top-k: invalid int value: '2.9'"),
    (["generate", "x", "--max-new-tokens", "-1"], "max_new_tokens must be an int >= 0, got -1"),
    (["generate"], "the following arguments are required: text"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["chat", "--model", "nowhere"], "'nowhere' is neither a checkpoint directory"),
])
def test_user_errors_are_one_line(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [s for s in err.splitlines() if not s.startswith("dsjax: load")]  # chat --model: loading, then error
    assert len(lines) == 1 and lines[0].startswith("dsjax: error: ") and message in lines[0], err
    assert "Traceback" not in err


def test_internal_error_one_line_and_a_report(capsys, monkeypatch, tmp_path):
    def broken(args, say):
        raise RuntimeError("an invariant broke\nsecond line")

    monkeypatch.setattr(cli, "_cmd_params", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cli.main(["params"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "internal error: RuntimeError: an invariant broke" in err
    (report,) = (tmp_path / "dsjax" / "crash").iterdir()
    assert str(report) in err and "Traceback" in report.read_text() and "second line" in report.read_text()
    with pytest.raises(RuntimeError, match="invariant"):  # --debug: the traceback, not the summary
        cli.main(["params", "--debug"])


def test_a_value_error_inside_jax_is_an_internal_error(capsys, monkeypatch, tmp_path):
    """JAX refusing what dsjax asked of it (a ValueError raised in jax) is dsjax's bug: reported
    as an internal error with a crash report, not as the user's mistake (exit 2). A dsjax
    ValueError stays a user error (test_user_errors_are_one_line)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    def broken(args, say):
        jax.device_put(jax.numpy.zeros(2), NamedSharding(jax.make_mesh((1,), ("x",)), P("x", "y")))

    monkeypatch.setattr(cli, "_cmd_params", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cli.main(["params"]) == 1
    err = capsys.readouterr().err
    assert "internal error: ValueError: " in err and len(list((tmp_path / "dsjax" / "crash").iterdir())) == 1


def test_info(capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["backend"] == "cpu" and info["kernels (auto)"] == "reference"
    assert info["jax"] and info["jaxlib"] and "compile cache" in info
    assert info["cpu head kernel"].startswith("ready (") == cpu_kernels.available()  # else why not
    assert "small" in info["named configs"] and info["tokenizer"] == str(bundled_tokenizer_path())


def test_generate_json_stop_and_logprobs(capsys):
    """--json: text, ids, finish_reason, usage, logprobs; --stop cuts at a string spanning
    a token boundary and ends the generation there."""
    base = ["generate", "The capital of France is", "--max-new-tokens", "8", "--dtype", "float32", "-q", "--json",
            "--no-token-healing"]  # text == decode(ids) (healed text leaves " is" out: test_generate_matches_...)
    assert cli.main(base + ["--logprobs", "2"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["finish_reason"] == "length" and full["usage"] == {"prompt_tokens": 6, "completion_tokens": 8}
    assert len(full["logprobs"]) == 8 and all(len(e["top_logprobs"]) == 2 for e in full["logprobs"])
    assert [e["token"] for e in full["logprobs"]] == full["ids"]
    tok = dsjax.load_tokenizer()
    pieces = [tok.decode(full["ids"][:i]) for i in range(9)]
    k = 3  # a stop string made of the end of token k-1 and the start of token k
    stop = pieces[k][-2:] + full["text"][len(pieces[k]):][:2]
    assert cli.main(base + ["--stop", stop]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["text"] == full["text"][: full["text"].index(stop)] and cut["finish_reason"] == "stop"
    assert cut["stop"] == stop and cut["ids"] == full["ids"][: len(cut["ids"])] and len(cut["ids"]) < 8


def test_weight_dtype_runs_the_stored_model(capsys):
    """--weight-dtype bfloat16 generates what dsjax.store_weights' model generates in process
    (the same greedy ids from the same prompt ids); under --dtype bfloat16 it is refused by name."""
    argv = ["generate", "def add(a, b):", "--max-new-tokens", "6", "--dtype", "float32", "--weight-dtype", "bfloat16",
            "-q", "--ids", "--no-token-healing"]
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    model = dsjax.store_weights(dsjax.load_model(dtype="float32"))
    engine = dsjax.Engine(model, max_slots=1, capacity=256)
    want = engine.generate([got["prompt_ids"]], dsjax.SamplingParams(max_tokens=6))[0]
    assert got["new_ids"] == want
    assert cli.main(argv[:2] + ["--dtype", "bfloat16", "--weight-dtype", "bfloat16", "-q"]) != 0
    assert "--weight-dtype bfloat16 stores weights under float32 activations" in capsys.readouterr().err


def test_chat_sends_the_recipes_encoding(capsys, monkeypatch):
    """Two user lines on stdin: the prompt of turn 2 is deepseek-recipe's encoding of the
    conversation so far (turn 1's reply included), nothing hand-written."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n\nWhat is 2+2?\n"))
    assert cli.main(["chat", "--max-new-tokens", "4", "--dtype", "float32", "--show-prompt-ids"]) == 0
    out, err = capsys.readouterr()
    turns = [json.loads(s) for s in err.splitlines() if s.startswith("{")]
    assert [t["turn"] for t in turns] == [1, 2]
    assert out.count("\n") >= 2 and turns[0]["reply"]["content"] in out
    encode = recipe.DeepseekV4Encoding().with_tokenizer(recipe.Tokenizer.from_file(str(bundled_tokenizer_path())))
    first = [recipe.UserMessage("Hello there")]
    assert turns[0]["prompt_ids"] == encode.encode(recipe.Conversation(first, thinking_mode=False))
    conversation = first + [recipe.AssistantMessage(turns[0]["reply"]["content"]), recipe.UserMessage("What is 2+2?")]
    assert turns[1]["prompt_ids"] == encode.encode(recipe.Conversation(conversation, thinking_mode=False))


def test_generate_with_speculation(shared_cache):
    """--num-draft-tokens: greedy output unchanged, the speculation counters on stderr."""
    out = _run("generate", PROMPT, "--max-new-tokens", "6", "--ids", "--dtype", "float32",
               "--num-draft-tokens", "2", "--spec-policy", "fixed", "--no-token-healing", cache_dir=shared_cache)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["prompt_ids"] == [0] + dsjax.load_tokenizer().encode(PROMPT)  # as typed
    model = dsjax.load_model(dtype="float32")  # the CLI default, with its MTP layer
    assert result["new_ids"] == dsjax.generate(model, [result["prompt_ids"]], 6)[0]
    assert "drafts accepted" in out.stderr


def _interrupt(args, when, cache_dir):
    """Start `dsjax generate`, send SIGINT once `when(proc)` returns; (status, stderr, seconds to exit)."""
    proc = subprocess.Popen([sys.executable, "-m", "dsjax", "generate", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(cache_dir))
    try:
        seen = when(proc)
        sent = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        return proc.returncode, seen + err, time.perf_counter() - sent
    finally:
        proc.kill()


def _stderr_until(word):
    def when(proc):
        seen = ""
        while word not in seen:
            line = proc.stderr.readline()
            assert line, f"exited before {word!r}: {seen}"
            seen += line
        return seen
    return when


def test_ctrl_c_while_compiling_exits_130_in_one_line(tmp_path):
    status, err, took = _interrupt(["Hello", "--max-new-tokens", "4"], _stderr_until("compiling"), tmp_path)
    assert status == 130 and took < 10
    assert err.splitlines()[-1] == "dsjax: interrupted" and "Traceback" not in err, err


def test_ctrl_c_while_generating_exits_130_in_one_line(shared_cache):
    def first_text(proc):
        seen = _stderr_until("generating")(proc)
        assert proc.stdout.read(1)  # the first streamed character
        return seen

    # one more process over the warm cache: the same shapes as cold_then_warm (capacity 256)
    args = [PROMPT, "--max-new-tokens", "240", "--ignore-eos", "--seed", "3", "--temperature", "0.9"]
    status, err, took = _interrupt(args, first_text, shared_cache)
    assert status == 130 and took < 10
    assert err.splitlines()[-1] == "dsjax: interrupted" and "Traceback" not in err, err
