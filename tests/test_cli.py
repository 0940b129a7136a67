"""The CLI runs the built-in tiny model with the shipped tokenizer."""

import json
import subprocess
import sys

import dsjax
from dsjax.cli import load_tokenizer


def _run(*args):
    out = subprocess.run([sys.executable, "-m", "dsjax.cli", *args], capture_output=True, text=True, timeout=600)
    return out


def test_generate_matches_library_call():
    out = _run("generate", "Hello, world", "--max-new-tokens", "5", "--ids", "--seed", "3", "--temperature", "0.9")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    encode, decode = load_tokenizer()
    assert result["prompt_ids"] == [0] + encode("Hello, world")
    model = dsjax.load_model("tiny", seed=3)
    expected = dsjax.generate(model, [result["prompt_ids"]], 5, temperature=0.9, seed=3)[0]
    assert result["new_ids"] == expected
    text = _run("generate", "Hello, world", "--max-new-tokens", "5", "--seed", "3", "--temperature", "0.9")
    assert text.stdout.rstrip("\n") == decode(expected)


def test_params_json():
    out = _run("params", "--config", "v4-flash", "--json")
    assert out.returncode == 0, out.stderr
    counts = json.loads(out.stdout)
    from dsjax.param_count import count_params
    assert counts["total"] == count_params(dsjax.load_config("v4-flash"))["total"]


def test_errors_name_the_problem():
    out = _run("generate", "x", "--model", "no-such-model")
    assert out.returncode == 2 and "no-such-model" in out.stderr and "named configs" in out.stderr


def test_generate_with_speculation():
    """--num-draft-tokens: greedy output unchanged, the speculation counters on stderr."""
    out = _run("generate", "Hello, world", "--max-new-tokens", "6", "--ids", "--dtype", "float32",
               "--num-draft-tokens", "2", "--spec-policy", "fixed")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    model = dsjax.load_model("tiny", dtype="float32", seed=0)
    assert result["new_ids"] == dsjax.generate(model, [result["prompt_ids"]], 6)[0]
    assert "drafts accepted" in out.stderr
