"""Every command in README.md runs in a test: here, or in the test named for it here.

Executed here: the quickstart Python block (the built-in model, a few tokens), the main job
(`dsjax generate "def fibonacci(n):" --max-new-tokens 48`, in this process) and the
abstract reports (`dsjax info / params / cache / memory`: nothing is allocated). Every other
`dsjax` line is parsed by the CLI's own argparse parser (so a renamed flag fails here) and
its command is run by the test module named in COVERED. `pip install` lines: the extras
they name exist, and the test command is the one `.ci/run` runs. The Engine block is the
engine test_engine.py compiles and serves (README_ENGINE)."""

import ast
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from dsjax import cli
from dsjax.weights import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
TEST_COMMAND = ('pip install -c constraints.txt -e ".[test]" && '
                "python -m pytest -q -n auto --maxprocesses=4 --dist loadfile --max-worker-restart=0")
MAIN_JOB = 'dsjax generate "def fibonacci(n):" --max-new-tokens 48'
MAIN_ARGV = shlex.split(MAIN_JOB)[1:]
RUN_HERE = ("info", "params", "cache", "memory")
# command -> (test module that runs it, a string that module must contain)
COVERED = {
    "generate": ("test_cli.py", '"generate"'),
    "chat": ("test_cli.py", '"chat"'),
    "serve": ("test_serving.py", "/v1/chat/completions"),
    "batch": ("test_batch.py", '"batch"'),
    "verify": ("test_batch.py", '"verify"'),
    "convert": ("test_quantized.py", '"convert"'),
}


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def shell_commands() -> list[list[str]]:
    """Each command of the README's bash blocks as shell words (continuations and quoted
    arguments over several lines joined, comments dropped)."""
    out = []
    for block in blocks("bash"):
        lines, i = block.replace("\\\n", " ").split("\n"), 0
        while i < len(lines):
            line = lines[i]
            i += 1
            while True:
                try:
                    words = shlex.split(line, comments=True)
                    break
                except ValueError:  # a quote open to the next line (curl -d '{...}')
                    line += "\n" + lines[i]
                    i += 1
            if words:
                out.append(words)
    return out


def dsjax_argv(words: list[str]) -> list[list[str]]:
    """The dsjax invocations in a command (a `pip ... && dsjax ...` chain included)."""
    parts, cur = [], []
    for w in words + ["&&"]:
        if w == "&&":
            parts.append(cur)
            cur = []
        else:
            cur.append(w)
    return [p[1:] for p in parts if p and p[0] == "dsjax"]


def test_readme_is_short_and_undated():
    assert len(README.splitlines()) <= 300
    assert not re.search(r"sitting|that morning|this afternoon|\d{4}-\d{2}-\d{2}", README)


def test_the_two_set_up_commands():
    first, second = blocks("bash")[:2]
    assert first.strip() == "pip install -e . && " + MAIN_JOB
    assert second.strip() == TEST_COMMAND
    ci = (ROOT / ".ci" / "run").read_text()
    pytest_part = TEST_COMMAND.split("&& ", 1)[1]
    assert pytest_part in ci, ".ci/run must run the README's test command"


def test_pip_extras_exist_and_the_console_script():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["dsjax"] == "dsjax.cli:main"
    extras = set(project["optional-dependencies"])
    for command in shell_commands():
        for w in command:
            if w.startswith(".[") or w == ".":
                assert set(filter(None, w.strip(".[]").split(","))) <= extras, command


def test_every_dsjax_command_parses_and_is_run_somewhere():
    parser = cli.build_parser()
    seen = set()
    for command in shell_commands():
        for argv in dsjax_argv(command):
            args = parser.parse_args(argv)  # a flag the CLI lacks raises UsageError
            seen.add(args.command)
            if args.command in RUN_HERE or argv == MAIN_ARGV:
                continue
            module, needle = COVERED[args.command]
            assert needle in (ROOT / "tests" / module).read_text(), (command, module)
    assert seen >= {"generate", "info"}


def test_curl_request_is_one_the_server_tests_send():
    (curl,) = [c for c in shell_commands() if c[0] == "curl"]
    req = json.loads(curl[curl.index("-d") + 1])
    assert req["model"] == DEFAULT_MODEL and req["thinking"] == {"type": "disabled"}
    assert any(w.endswith("/v1/chat/completions") for w in curl) and "/v1/chat/completions" in (ROOT / "tests/test_serving.py").read_text()


def test_engine_block_is_the_engine_test_engine_serves():
    (engine_block,) = [b for b in blocks("python") if "Engine(model" in b]
    call = next(n for n in ast.walk(ast.parse(engine_block.replace("    ...", "    pass")))
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Engine")
    readme_kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    source = (ROOT / "tests" / "test_engine.py").read_text()
    (assign,) = [n for n in ast.parse(source).body if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", "") == "README_ENGINE"]
    tested = {k.arg: ast.literal_eval(k.value) for k in assign.value.keywords}
    assert readme_kw == tested
    assert "def test_readme_engine_warmup_compiles_eight_programs_and_serving_none" in source


@pytest.mark.parametrize("name", RUN_HERE)
def test_abstract_reports_run(name, capsys):
    argvs = [a for c in shell_commands() for a in dsjax_argv(c) if a[0] == name]
    assert argvs, name
    for argv in argvs:
        assert cli.main([*argv, "--quiet"]) == 0, argv
        assert capsys.readouterr().out.strip()


def test_main_job_runs(capsys):
    assert cli.main([*MAIN_ARGV, "--quiet"]) == 0
    assert capsys.readouterr().out.strip()  # a function body, streamed to stdout


def test_quickstart_runs():
    quickstart = blocks("python")[0]
    namespace = {}
    exec(compile(quickstart, "README.md quickstart", "exec"), namespace)
    c, tok = namespace["c"], namespace["tok"]
    assert isinstance(namespace["text"], str) and namespace["text"]
    assert [len(ids) for ids in namespace["new_ids"]] == [8, 8]
    assert c.finish_reason in ("stop", "length") and len(c.logprobs) == len(c.ids)
    assert namespace["logits"].shape == (1, 4, namespace["model"].config.vocab_size)
    assert namespace["ids"][0] == tok.bos_id


def test_relative_links_in_the_documents_resolve():
    docs = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "REPORT.md",
            ROOT / "dsjax" / "weights" / "dsjax-tiny-py" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [(d.name, target) for d in docs
              for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", d.read_text(encoding="utf-8"))
              if not target.startswith(("http://", "https://")) and not (d.parent / target).exists()]
    assert not broken
