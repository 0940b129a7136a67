"""Offline batch jobs (dsjax.batch, `dsjax batch`, `dsjax verify`) on the random `tiny` model.

One record set and one engine shape (4 slots, batch-invariant, the same capacity) serve
every test, so the in-process tests share compiled programs; subprocesses only for the
SIGKILL test, over one compile cache of their own."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dsjax
import dsjax.batch
from dsjax import cli, inspect
from dsjax.batch.manifest import manifest_path
from dsjax.batch.runner import context
from dsjax.protocol import CHAT, prepare

ROOT = Path(__file__).resolve().parents[1]
SLOTS = ["--max-slots", "4", "--batch-invariant", "--max-new-tokens", "6"]


def _records(n: int = 12) -> list[dict]:
    """Text and id prompts of different lengths; greedy, seeded and unseeded sampling."""
    out = []
    for i in range(n):
        r = {"id": f"r{i}", "max_tokens": 3 + i % 4}
        if i % 2:
            r["prompt_ids"] = [0] + [100 + 7 * j for j in range(i + 1)]
        else:
            r["prompt"] = "def f(n):" + " x" * i
        if i % 3 == 1:
            r.update(temperature=0.8, top_p=0.9, seed=i)
        elif i % 3 == 2:
            r.update(temperature=0.7)  # no seed: derived from the run seed and the id
        out.append(r)
    return out


RECORDS = _records()


@pytest.fixture(scope="module")
def model():
    m = dsjax.load_model("tiny", dtype="float32")
    return m.replace(options=m.options.replace(batch_invariant=True))


@pytest.fixture(scope="module")
def tokenizer(model):
    return dsjax.load_tokenizer(model)


@pytest.fixture(scope="module")
def results(model, tokenizer):
    return dsjax.batch.run(model, RECORDS, max_slots=4, max_new_tokens=6, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The uninterrupted job, through the CLI in this process: (input, output)."""
    d = tmp_path_factory.mktemp("job")
    inp, out = d / "in.jsonl", d / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert cli.main(["batch", "--input", str(inp), "--output", str(out), "--model", "tiny", "--dtype", "float32",
                     "--quiet", *SLOTS]) == 0
    return inp, out


def test_run_equals_generate_per_record(model, tokenizer, results):
    """The oracle: dsjax.generate alone on each record, with its settings and its seed."""
    assert [r["id"] for r in results] == [r["id"] for r in RECORDS]  # input order
    for rec, res in zip(RECORDS[:6], results):  # text / ids x greedy / seeded / derived seed
        prompt = rec.get("prompt", rec.get("prompt_ids"))
        settings = {k: rec[k] for k in ("temperature", "top_p") if k in rec}
        seed = rec.get("seed", dsjax.batch.derived_seed(0, rec["id"]))
        assert res["seed"] == seed
        (c,) = dsjax.generate(model, [prompt], rec["max_tokens"], seed=seed, tokenizer=tokenizer, details=True,
                              **settings)
        assert res["ids"] == c.ids, rec["id"]
        assert res["text"] == c.text and res["finish_reason"] == c.finish_reason and res["usage"] == c.usage


def test_cli_output_is_the_library_result(job, results):
    _, out = job
    assert [json.loads(line) for line in out.read_text().splitlines()] == results
    manifest = json.loads(manifest_path(out).read_text())
    assert manifest["complete"] and manifest["settings"]["batch_invariant"] and manifest["records"] == len(RECORDS)


def test_batch_invariant_logprobs_over_batch_sizes_and_order(model, tokenizer):
    """Batch-invariant mode: the same job at 1, 4 and 16 slots, in shuffled input order, and
    on the mesh data=2,expert=4 gives every record bitwise the same logprobs (and tokens);
    sampled records included."""
    records = [{**r, "logprobs": 2} for r in RECORDS]
    run = lambda recs, slots: {r["id"]: r for r in dsjax.batch.run(  # noqa: E731
        model, recs, max_slots=slots, max_new_tokens=6, tokenizer=tokenizer)}
    reference = run(records, 4)
    assert all(len(r["logprobs"]) == len(r["ids"]) for r in reference.values())
    shuffled = random.Random(3).sample(records, len(records))
    for slots, recs in ((1, records), (16, records), (4, shuffled)):
        assert run(recs, slots) == reference, slots
    for mesh, slots in (("data=2,expert=4", 16),):  # 8 fake CPU devices (conftest): batch and expert shards
        on_mesh = dsjax.load_model("tiny", dtype="float32", mesh=mesh)
        on_mesh = on_mesh.replace(options=on_mesh.options.replace(batch_invariant=True))
        got = {r["id"]: r for r in dsjax.batch.run(on_mesh, shuffled, max_slots=slots, max_new_tokens=6,
                                                   tokenizer=tokenizer)}
        assert got == reference, mesh


def _env(cache_dir) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "DSJAX_COMPILE_CACHE": str(cache_dir)}


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.slow
def test_sigkill_and_resume_equals_uninterrupted(job, tmp_path):
    """Killed with SIGKILL after k finished lines (k random), 3 times, once with a torn last
    line added: the resumed job's output is the uninterrupted one, byte for byte."""
    inp, reference = job
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "dsjax.cli", "batch", "--input", str(inp), "--output", str(out), "--model", "tiny",
           "--dtype", "float32", "--quiet", *SLOTS]
    env = _env(tmp_path / "compile_cache")
    rng = random.Random(16)
    kills = 0
    for attempt in range(6):
        target = _lines(out) + rng.randint(1, 3)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 600
        while proc.poll() is None and _lines(out) < target and time.monotonic() < deadline:
            time.sleep(0.02)
        if proc.poll() is None and kills < 3:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            if kills == 2:  # a crash in the middle of a write
                with open(out, "ab") as f:
                    f.write(b'{"id": "r')
            continue
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()[-2000:]
        break
    assert kills >= 2  # the job was really interrupted
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(r["id"] for r in RECORDS) and len(set(ids)) == len(ids)
    assert out.read_bytes() == reference.read_bytes()


def test_rerun_with_other_settings_is_refused(job, capsys, monkeypatch):
    """Refused by name, before the model is loaded (the flags' settings need no model)."""
    inp, out = job
    before = out.read_bytes()
    loads = []
    monkeypatch.setattr(dsjax, "load_model", lambda *a, **k: loads.append(a) or pytest.fail("model loaded"))
    rc = cli.main(["batch", "--input", str(inp), "--output", str(out), "--model", "tiny", "--dtype", "float32",
                   "--quiet", "--max-slots", "4", "--batch-invariant", "--max-new-tokens", "7", "--seed", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and not loads
    assert "seed: 0 -> 1" in err and "max_new_tokens: 6 -> 7" in err, err
    assert out.read_bytes() == before


def test_batch_invariant_job_resumes_at_another_batch_size(job, tmp_path, capsys):
    """In batch-invariant mode max_slots is no setting a result depends on: a job cut after
    3 lines resumes at 16 slots and ends byte for byte as the uninterrupted 4-slot job."""
    inp, ref = job
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"".join(ref.read_bytes().splitlines(keepends=True)[:3]))
    manifest_path(out).write_text(manifest_path(ref).read_text())
    assert cli.main(["batch", "--input", str(inp), "--output", str(out), "--model", "tiny", "--dtype", "float32",
                     "--max-slots", "16", "--batch-invariant", "--max-new-tokens", "6"]) == 0
    assert f"{len(RECORDS) - 3} records to run (3 finished before" in capsys.readouterr().err
    assert out.read_bytes() == ref.read_bytes()


def test_speculative_job_is_lossless_and_recorded(results, tmp_path, capsys):
    """--num-draft-tokens: greedy records come out as the plain job's (verification is
    lossless); the manifest records K and the one decode step per dispatch it runs; resuming
    with another K is refused, naming it."""
    greedy = [r for r in RECORDS if "temperature" not in r]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in greedy))
    cmd = ["batch", "--input", str(inp), "--output", str(out), "--model", "tiny", "--dtype", "float32", "--quiet",
           "--max-slots", "4", "--max-new-tokens", "6", "--num-draft-tokens"]
    assert cli.main([*cmd, "1"]) == 0
    plain = {r["id"]: r for r in results}
    fields = lambda r: (r["id"], r["ids"], r["text"], r["finish_reason"])  # noqa: E731
    assert [fields(json.loads(line)) for line in out.read_text().splitlines()] == [fields(plain[r["id"]])
                                                                                  for r in greedy]
    settings = json.loads(manifest_path(out).read_text())["settings"]
    assert settings["num_draft_tokens"] == 1 and settings["decode_steps"] == 1
    capsys.readouterr()
    assert cli.main([*cmd, "2"]) == 1
    assert "num_draft_tokens: 1 -> 2" in capsys.readouterr().err


def test_rerun_of_a_finished_job_changes_nothing(job, capsys):
    inp, out = job
    before = out.read_bytes()
    assert cli.main(["batch", "--input", str(inp), "--output", str(out), "--model", "tiny", "--dtype", "float32",
                     *SLOTS]) == 0
    assert "0 run now" in capsys.readouterr().err
    assert out.read_bytes() == before


BAD = [
    "{not json",
    json.dumps({"id": "np", "max_tokens": 3}),  # no prompt
    json.dumps({"id": "bt", "prompt": "x", "temperature": -1}),  # bad parameter
    json.dumps({"id": "long", "prompt_ids": [1] * 65536}),  # past the model's positions
    json.dumps({"id": "r0", "prompt": "again"}),  # a repeated id
]


def _bad_input(path: Path) -> list[int]:
    """RECORDS with BAD lines interleaved; returns the bad lines' numbers."""
    lines, bad = [], []
    for i, r in enumerate(RECORDS):
        lines.append(json.dumps(r))
        if i < len(BAD):
            lines.append(BAD[i])
            bad.append(len(lines))
    path.write_text("\n".join(lines) + "\n")
    return bad


def test_malformed_lines_skip(model, tokenizer, results, tmp_path):
    bad = _bad_input(tmp_path / "in.jsonl")
    out = dsjax.batch.run(model, tmp_path.joinpath("in.jsonl").read_text(), max_slots=4, max_new_tokens=6,
                          tokenizer=tokenizer)
    errors = [o for o in out if "error" in o]
    assert [e["error"]["line"] for e in errors] == bad
    messages = [e["error"]["message"] for e in errors]
    assert "not valid JSON" in messages[0] and "prompt" in messages[1] and "temperature" in messages[2]
    assert "65536" in messages[3] and "line 1 and line 10" in messages[4], messages
    assert [o for o in out if "error" not in o] == results  # nothing else lost or changed


def test_malformed_lines_fail_runs_nothing(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bad = _bad_input(inp)
    rc = cli.main(["batch", "--input", str(inp), "--output", str(out), "--model", "tiny", "--dtype", "float32",
                   "--on-error", "fail", *SLOTS])
    err = capsys.readouterr().err
    assert rc == 1 and "5 bad input line(s), nothing was run" in err
    assert all(f"line {n}:" in err for n in bad), err
    assert "Traceback" not in err and not out.exists()


def test_verify_passes_then_flags_a_tampered_line(job, tmp_path, capsys):
    _, out = job
    assert cli.main(["verify", str(out), "--quiet", "--sample", "4", "--seed", "1"]) == 0
    tampered = tmp_path / "out.jsonl"
    lines = out.read_text().splitlines()
    row = json.loads(lines[5])
    row["ids"][-1] = (row["ids"][-1] + 1) % 1000
    lines[5] = json.dumps(row, ensure_ascii=False)
    tampered.write_text("\n".join(lines) + "\n")
    manifest_path(tampered).write_bytes(manifest_path(out).read_bytes())
    capsys.readouterr()
    assert cli.main(["verify", str(tampered), "--quiet"]) == 1  # all ids
    assert capsys.readouterr().out.split() == [json.dumps(row["id"])]


def test_openai_lines_equal_generate_on_the_served_prompt(model, tokenizer):
    """OpenAI batch lines are converted as `dsjax serve` converts them (the oracle: the
    serving protocol's prompt ids, then dsjax.generate with the record's seed)."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "disabled"}, "max_tokens": 4,
            "temperature": 0.8}
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "def f(n):", "max_tokens": 5, "temperature": 0}},
             {"custom_id": "m", "method": "POST", "url": "/v1/chat/completions", "body": chat}]
    comp, msg = dsjax.batch.run(model, lines, max_slots=4, tokenizer=tokenizer)
    (c,) = dsjax.generate(model, ["def f(n):"], 5, tokenizer=tokenizer, details=True)
    assert comp["ids"] == c.ids and comp["text"] == c.text and comp["response"]["choices"][0]["text"] == c.text
    seed = dsjax.batch.derived_seed(0, "m")
    served = prepare(CHAT, {**chat, "model": model.config.name, "seed": seed}, context(model, tokenizer,
                                                                                      model.config.name))
    (m,) = dsjax.generate(model, [served.choices[0].prompt], 4, temperature=0.8, seed=seed, details=True)
    assert msg["seed"] == seed and msg["ids"] == m.ids
    assert msg["response"]["choices"][0]["message"]["content"] == msg["text"]
    assert msg["usage"]["prompt_tokens"] == len(served.choices[0].prompt)


def test_lines_that_score_their_prompts(model, tokenizer):
    """A raw record with prompt_logprobs (max_tokens 0: scored only; or beside generation)
    and an OpenAI completions line with echo + logprobs give dsjax.score's logprobs."""
    ids = [0] + [100 + 7 * j for j in range(40)]
    lines = [{"id": "s", "prompt_ids": ids, "prompt_logprobs": 2, "max_tokens": 0},
             {"id": "t", "prompt": "def f(n):\n    return n", "prompt_logprobs": 0, "max_tokens": 2},
             {"custom_id": "e", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0}}]
    s, t, e = dsjax.batch.run(model, lines, max_slots=4, tokenizer=tokenizer)
    want = dsjax.score(model, [ids])[0].token_logprobs
    assert s["ids"] == [] and s["finish_reason"] == "length" and s["prompt_logprobs"][0] is None
    assert [x["logprob"] for x in s["prompt_logprobs"][1:]] == pytest.approx(want, abs=1e-5)
    assert all(len(x["top_logprobs"]) == 2 and x["rank"] >= 1 for x in s["prompt_logprobs"][1:])
    assert e["response"]["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
    text_ids = [0] + tokenizer.encode("def f(n):\n    return n")
    assert len(t["ids"]) == 2 and [x["logprob"] for x in t["prompt_logprobs"][1:]] == pytest.approx(
        dsjax.score(model, [text_ids])[0].token_logprobs, abs=1e-5)


def test_verify_refuses_another_environment(job, tmp_path, capsys):
    _, out = job
    copy = tmp_path / "out.jsonl"
    copy.write_bytes(out.read_bytes())
    manifest = json.loads(manifest_path(out).read_text())
    manifest["environment"]["jax"] = "0.0.1"
    manifest_path(copy).write_text(json.dumps(manifest))
    assert cli.main(["verify", str(copy), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert 'jax: "0.0.1" -> ' in err and "cannot verify" in err, err


def test_prefix_cache_job_computes_a_shared_prompt_once(tmp_path, capsys):
    """--prefix-cache-mb: records behind a 100-token shared prompt take its 96 tokens of whole
    16-token blocks from the cache after the first, and the output file is byte for byte the
    one of the same job whose budget holds no block (the same chunk grid, no hits); the
    manifest records the grid."""
    shared = [100 + (7 * j) % 900 for j in range(100)]
    records = [{"id": f"s{i}", "prompt_ids": shared + [200 + i] * (i + 1), "max_tokens": 4, "logprobs": 2}
               for i in range(6)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in records))
    outputs, said = [], []
    for mib in ("8", "0.01"):  # 0.01 MiB: under one block of tiny (43 KiB): every block is dropped at once
        out = tmp_path / f"out-{mib}.jsonl"
        assert cli.main(["batch", "--input", str(inp), "--output", str(out), "--model", "tiny", "--dtype",
                         "float32", *SLOTS, "--prefill-chunk", "16", "--prefix-cache-mb", mib]) == 0
        outputs.append(out.read_text())
        said.append(capsys.readouterr().err)
        assert json.loads(manifest_path(out).read_text())["settings"]["prefix_cache"] is True
    assert outputs[0] == outputs[1]
    assert "prefix cache: 5 of 6 records hit, 480 prompt tokens taken from it" in said[0]
    assert "prefix cache: 0 of 6 records hit" in said[1]


def test_record_routing_adds_each_records_expert_load(model, results, tmp_path, capsys):
    """--record-routing: each line gains "expert_counts", which are the full forward's routing
    (dsjax.inspect) over the record's prompt and tokens counted per layer and expert, split at the
    prompt's last position (its step makes the first token); the rest of every line is the plain
    job's, and the manifest records the flag. Refused with speculation."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    cmd = ["batch", "--input", str(inp), "--output", str(out), "--model", "tiny", "--dtype", "float32", "--quiet",
           *SLOTS, "--record-routing"]
    assert cli.main(cmd) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{k: v for k, v in line.items() if k != "expert_counts"} for line in lines] == results
    assert json.loads(manifest_path(out).read_text())["settings"]["record_routing"] is True
    cfg, checked = model.config, [(rec["prompt_ids"], line) for rec, line in zip(RECORDS, lines) if "prompt_ids" in rec]
    seqs = [prompt + line["ids"][:-1] for prompt, line in checked]
    padded = np.zeros((len(seqs), max(map(len, seqs))), np.int32)  # causal: what follows a position changes nothing
    for row, seq in zip(padded, seqs):
        row[: len(seq)] = seq
    _, trace = inspect.forward(model, padded, capture="layers.*.moe.experts")
    for n, (prompt, line) in enumerate(checked):
        p, end = len(prompt) - 1, len(seqs[n])  # the prompt's last position's step makes the first token
        for part, positions in (("prompt", slice(0, p)), ("generated", slice(p, end))):
            want = [np.bincount(trace[f"layers.{i}.moe.experts"][n, positions].ravel(),
                                minlength=cfg.n_routed_experts).tolist() for i in range(cfg.num_hidden_layers)]
            assert line["expert_counts"][part] == want, (line["id"], part)
    capsys.readouterr()
    assert cli.main([*cmd[:4], str(tmp_path / "spec.jsonl"), *cmd[5:], "--num-draft-tokens", "1"]) == 1
    assert "--record-routing is not supported with --num-draft-tokens" in capsys.readouterr().err
