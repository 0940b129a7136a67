"""dsjax.testing.assert_golden: written when missing, equal results pass, a changed token
fails with a diff that names the entry, the first differing position and both sides'
tokens and text, and updating rewrites the file."""

import json
import warnings

import numpy as np
import pytest

import dsjax
from dsjax.testing import UPDATE_ENV, assert_golden


@pytest.fixture(scope="module")
def tok():
    return dsjax.load_tokenizer()


def test_written_then_compared(tmp_path, tok, monkeypatch):
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    path = tmp_path / "golden" / "prompts.json"
    ids = tok.encode("def fibonacci(n):\n    return n")
    results = {"fib": ids, "empty": [], "text": "hello world"}
    with pytest.warns(UserWarning, match="golden file written"):
        assert_golden(path, results)
    stored = json.loads(path.read_text())
    assert stored["results"] == results and stored["environment"]["jax"]
    assert_golden(path, {"fib": np.array(ids), "empty": [], "text": "hello world"})  # arrays compare by value

    changed = list(ids)
    changed[5] = tok.encode(" while")[0]
    with pytest.raises(AssertionError) as e:
        assert_golden(path, {"fib": changed, "empty": [], "text": "hello world!"}, tokenizer=tok)
    msg = str(e.value)
    assert "2 of 3 entries differ" in msg and "fib: differs at position 5" in msg
    assert repr(tok.decode(ids[1:10])) in msg and repr(tok.decode(changed[1:10])) in msg  # both sides, as text
    assert "text: differs at character 11" in msg and "empty" not in msg

    with pytest.raises(AssertionError, match="new: in the results, not in the golden file"):
        assert_golden(path, {**results, "new": [1]})
    monkeypatch.setenv(UPDATE_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an update writes silently
        assert_golden(path, {"fib": changed})
    monkeypatch.delenv(UPDATE_ENV)
    assert_golden(path, {"fib": changed})


def test_a_list_is_keyed_by_index_and_bad_files_are_named(tmp_path):
    path = tmp_path / "list.json"
    with pytest.warns(UserWarning):
        assert_golden(path, [[1, 2, 3], [4]])
    with pytest.raises(AssertionError, match=r"1: differs at position 1 \(golden 1 long, got 2\)"):
        assert_golden(path, [[1, 2, 3], [4, 5]])
    path.write_text("not json")
    with pytest.raises(ValueError, match="not a golden file written by dsjax.testing"):
        assert_golden(path, [[1]])
    with pytest.raises(TypeError, match="entry 0 is a object"):
        assert_golden(tmp_path / "other.json", [object()])
