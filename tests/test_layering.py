"""The package's import graph, read with `ast` (nothing is imported): imports run downward
only, with no circles, so each layer can be read and tested without the ones above it.

    cli -> serving / batch / train -> command -> generate, scoring, protocol -> output -> api
        -> engine -> checkpoint, model -> layers -> kernels, sharding.rules, memory
        -> params -> config

The engine meets the model through one door, `dsjax.model.interface` (forward, cache, head,
drafters): of `dsjax.model` and `dsjax.layers` it imports that module and nothing else.

A model generation is a package, not a flag: DeepSeek-V4 and V4.1 are sibling packages
(`dsjax/model/v4/`, `dsjax/model/v41/`) chosen once by `dsjax.model.family.family_of(cfg)`;
outside the V4.1 package (and the config schema that defines it) no code reads `cfg.v41`.

The front ends (serving, batch) stand on the library, not on each other: what they share
(the OpenAI / Anthropic translation, the output processor, how a command runs) lies below
them, and only the CLI, the top, imports the front ends it launches.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dsjax"

# Rank of each part of the package: a module may import only parts of equal or lower rank.
RANKS = {
    "dsjax.config": 0, "dsjax.tokenizer": 0, "dsjax.compile_cache": 0,  # host-side text; process setup
    "dsjax.code_memory": 0,  # compiled code's memory mappings against the kernel's limit
    "dsjax.weights": 0,  # where bundled checkpoints live (paths only)
    "dsjax.params": 1,
    "dsjax.sharding.rules": 2, "dsjax.sharding.distributed": 2, "dsjax.kernels": 2, "dsjax.memory": 2,
    "dsjax.sharding.expert_dispatch": 2,  # the expert-parallel exchange (rows there and back), below the MoE
    "dsjax.layers": 3,
    "dsjax.model": 4,
    "dsjax.checkpoint": 5, "dsjax.param_count": 5,
    "dsjax.engine": 6,
    "dsjax.api": 7,
    "dsjax.output": 8,  # the output processor: token events -> text, stop strings, logprobs
    "dsjax.generate": 9, "dsjax.chat": 9, "dsjax.scoring": 9, "dsjax.inspect": 9, "dsjax": 9,
    "dsjax.protocol": 9,  # the OpenAI / Anthropic translation, served and batched alike
    "dsjax.command": 10,  # how every command runs, its common flags, loading
    "dsjax.serving": 11, "dsjax.batch": 11, "dsjax.train": 11, "dsjax.testing": 11,
    "dsjax.cli": 12, "dsjax.__main__": 12,  # the top: it launches the front ends
}
# Front ends: none imports another (equal ranks would allow it; the CLI, above them, may).
FRONT_ENDS = ("dsjax.serving", "dsjax.batch")
# Below the model, a mechanism file sees only these.
LAYERS_MAY_IMPORT = ("dsjax.config", "dsjax.params", "dsjax.sharding.rules", "dsjax.sharding.expert_dispatch",
                     "dsjax.kernels", "dsjax.layers")
# The engine's one door into the model and the layers below it.
MODEL_INTERFACE = "dsjax.model.interface"
# Function-level imports of dsjax hide upward edges; only the CLI and the command helpers defer
# their imports (start-up time).
LAZY_ALLOWED = ("dsjax.cli", "dsjax.command")


def _modules() -> dict[str, Path]:
    mods = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = f
    return mods


MODULES = _modules()


def _resolve(name: str) -> str:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, whether the import is inside a function or class) for each dsjax import."""
    tree = ast.parse(path.read_text())
    nested = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            nested.update(id(n) for n in ast.walk(node) if n is not node)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                       for a in node.names]
        else:
            continue
        out += [(_resolve(t), id(node) in nested) for t in targets if t == "dsjax" or t.startswith("dsjax.")]
    return out


GRAPH = {m: [(t, lazy) for t, lazy in _imports(p) if t != m] for m, p in MODULES.items()}


def _rank(module: str) -> int:
    best = max((k for k in RANKS if module == k or module.startswith(k + ".")), key=len, default=None)
    assert best is not None, f"{module} has no place in RANKS: add it to the layering"
    return RANKS[best]


def test_every_module_has_a_rank():
    for m in MODULES:
        _rank(m)


def test_imports_run_downward():
    upward = [f"{m} -> {t}" for m, edges in GRAPH.items() for t, _ in edges if _rank(t) > _rank(m)]
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_layers_import_only_what_lies_below():
    bad = [f"{m} -> {t}" for m, edges in GRAPH.items() if m.startswith("dsjax.layers")
           for t, _ in edges if not t.startswith(LAYERS_MAY_IMPORT)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("below, above", [("dsjax.model", "dsjax.engine"), ("dsjax.engine", "dsjax.api"),
                                          ("dsjax.kernels", "dsjax.layers")])
def test_forbidden_edges(below, above):
    bad = [f"{m} -> {t}" for m, edges in GRAPH.items() if m.startswith(below)
           for t, _ in edges if t == above or t.startswith(above + ".")]
    assert not bad, "\n".join(bad)


def test_engine_imports_only_the_model_interface():
    bad = [f"{m} -> {t}" for m, edges in GRAPH.items() if m == "dsjax.engine" or m.startswith("dsjax.engine.")
           for t, _ in edges if t != MODEL_INTERFACE
           and any(t == p or t.startswith(p + ".") for p in ("dsjax.model", "dsjax.layers"))]
    assert MODEL_INTERFACE in MODULES
    assert not bad, f"the engine reaches past {MODEL_INTERFACE} (add what it needs there):\n" + "\n".join(bad)


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_no_front_end_imports_another(front_end):
    others = [f for f in FRONT_ENDS if f != front_end] + ["dsjax.cli"]
    bad = [f"{m} -> {t}" for m, edges in GRAPH.items() if m == front_end or m.startswith(front_end + ".")
           for t, _ in edges if any(t == o or t.startswith(o + ".") for o in others)]
    assert not bad, "a front end imports another (move what they share below them):\n" + "\n".join(bad)


@pytest.mark.parametrize("shared", ["dsjax.protocol", "dsjax.output", "dsjax.command"])
def test_what_front_ends_share_lies_below_them(shared):
    assert _rank(shared) < min(_rank(f) for f in FRONT_ENDS + ("dsjax.cli",))


def test_no_function_level_imports():
    lazy = [f"{m} -> {t}" for m, edges in GRAPH.items() if not m.startswith(LAZY_ALLOWED)
            for t, is_lazy in edges if is_lazy]
    assert not lazy, "function-level dsjax imports (a definition in the wrong file?):\n" + "\n".join(lazy)


# The model generations: sibling packages on the shared model modules (block, head, cache) and
# the layers; the modules that choose between them (family, forward, cache layout, stored
# format, the interface, the package namespace) lie above them.
GENERATIONS = ("dsjax.model.v4", "dsjax.model.v41")
ABOVE_GENERATIONS = ("dsjax.model", "dsjax.model.family", "dsjax.model.forward_pass", "dsjax.model.cache_layout",
                     "dsjax.model.stored", "dsjax.model.interface")


@pytest.mark.parametrize("generation", GENERATIONS)
def test_a_generation_imports_neither_its_sibling_nor_what_chooses_it(generation):
    others = [g for g in GENERATIONS if g != generation]
    bad = [f"{m} -> {t}" for m, edges in GRAPH.items() if m == generation or m.startswith(generation + ".")
           for t, _ in edges if t in ABOVE_GENERATIONS or any(t == o or t.startswith(o + ".") for o in others)]
    assert all(m in MODULES for m in ABOVE_GENERATIONS)
    assert not bad, "a model package reaches sideways or up (move what they share to dsjax/model/):\n" + "\n".join(bad)


# Where the V4.1 config (`ModelConfig.v41`) may be read: its package, and the config that parses it.
V41_READERS = ("dsjax/model/v41/", "dsjax/config/")


def _v41_reads(path: Path) -> list[int]:
    """Line numbers of attribute reads `<anything>.v41` in a file."""
    return [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute) and n.attr == "v41"]


def test_v41_is_read_only_in_its_package():
    bad = [f"{rel}:{line}" for f in sorted(PACKAGE.rglob("*.py"))
           if not (rel := str(f.relative_to(PACKAGE.parent))).startswith(V41_READERS) for line in _v41_reads(f)]
    assert not bad, ("`.v41` read outside dsjax/model/v41/ (ask `family_of(cfg)`, or a config property such as "
                     "cfg.engram / cfg.dspark):\n" + "\n".join(bad))


def test_the_v41_check_sees_a_planted_read(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import dsjax.model.v41.family\n\ndef g(cfg):\n    return cfg.v41 is None\n")
    assert _v41_reads(f) == [4]


MAX_LINES = 500  # a file longer than this is split by mechanism (docs/architecture.md)


def test_no_file_over_500_lines():
    long = {str(f.relative_to(PACKAGE.parent)): n for f in sorted(PACKAGE.rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by mechanism): {long}"


def test_no_import_cycles():
    """Depth-first search for a cycle over every edge, function-level ones included."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t, _ in GRAPH.get(m, []):
            if state.get(t) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_checker_sees_a_planted_upward_import(tmp_path):
    """The parser finds function-level and module-level imports (a guard against a checker
    that silently sees nothing)."""
    f = tmp_path / "x.py"
    f.write_text("from dsjax.config import ModelConfig\n\ndef g():\n    from dsjax.engine import Engine\n")
    assert sorted(_imports(f)) == [("dsjax.config", False), ("dsjax.engine", True)]
