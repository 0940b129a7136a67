"""What the test suite compiles, per module, from one run with a warm compile cache: a pytest
plugin logs every program JAX looks up in its persistent cache (its key, the test, and the
compile time JAX stored beside the entry, or measured now for a miss), and the report sums
the distinct programs, so one warm run gives a cold run's compile bill without the cold run.

    PYTHONPATH=benchmarks python -m pytest -q -n auto --maxprocesses=4 --dist loadfile \\
        --max-worker-restart=0 -p suite_programs          # logs to $SUITE_PROGRAMS_DIR (/tmp/suite_programs)
    python benchmarks/suite_programs.py [--logs DIR] [--out benchmarks/results/suite_programs_cpu.json]

A module's "own" programs are those no other module ran (what sharing shapes across modules
would save is the "shared" share). Programs compiled again in every run (host callbacks,
interpret-mode Pallas kernels, temporary caches or checkpoints) show as "compiled this run"
in a warm run. Stored compile times are whole seconds (JAX's), measured under the run's load;
programs the tests run in subprocesses are not seen. Reads JAX internals
(`jax._src.compiler._cache_read` / `_cache_write`), so a JAX upgrade may need it mended.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import platform
import sys
import time

LOGS = os.environ.get("SUITE_PROGRAMS_DIR", "/tmp/suite_programs")

if "pytest" in sys.modules:  # loaded as a pytest plugin (-p suite_programs)
    import pytest
    from jax._src import compiler

    _test = ["<collection>"]
    _log = []

    def _write(line: str) -> None:
        if not _log:
            os.makedirs(LOGS, exist_ok=True)
            _log.append(open(os.path.join(LOGS, f"{os.getpid()}.tsv"), "a", buffering=1))
        _log[0].write(line + "\n")

    _read, _put = compiler._cache_read, compiler._cache_write

    def _cache_read(module_name, cache_key, *args, **kwargs):
        executable, seconds = _read(module_name, cache_key, *args, **kwargs)
        if executable is not None:
            _write(f"hit\t{_test[0]}\t{module_name}\t{cache_key}\t{seconds}")
        return executable, seconds

    def _cache_write(cache_key, compile_time_secs, module_name, *args, **kwargs):
        _write(f"compiled\t{_test[0]}\t{module_name}\t{cache_key}\t{compile_time_secs:.3f}")
        return _put(cache_key, compile_time_secs, module_name, *args, **kwargs)

    compiler._cache_read, compiler._cache_write = _cache_read, _cache_write

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _test[0] = item.nodeid
        start = time.perf_counter()
        yield
        _write(f"test\t{item.nodeid}\t\t\t{time.perf_counter() - start:.3f}")


def summarize(logs: str) -> dict:
    programs = {}  # key -> {"s": compile seconds, "modules": set, "name": function, "compiled": bool}
    test_s = collections.Counter()
    for path in glob.glob(os.path.join(logs, "*.tsv")):
        for line in open(path):
            kind, test, name, key, seconds = line.rstrip("\n").split("\t")
            module = test.split("::")[0]
            if kind == "test":
                test_s[module] += float(seconds)
                continue
            p = programs.setdefault(key, {"s": 0.0, "modules": set(), "name": name, "compiled": False})
            p["s"] = max(p["s"], float(seconds) if seconds != "None" else 0.0)
            p["modules"].add(module)
            p["compiled"] |= kind == "compiled"
    modules = collections.defaultdict(collections.Counter)
    for p in programs.values():
        for m in p["modules"]:
            if len(p["modules"]) == 1:
                modules[m]["own_compile_s"] += p["s"]
                modules[m]["own_programs"] += 1
            else:
                modules[m]["shared_compile_s"] += p["s"] / len(p["modules"])
            if p["compiled"]:
                modules[m]["compiled_this_run_s"] += p["s"] / len(p["modules"])
    functions = collections.defaultdict(collections.Counter)
    for p in programs.values():
        functions[p["name"]]["compile_s"] += p["s"]
        functions[p["name"]]["programs"] += 1
    rows = sorted(modules, key=lambda m: -(modules[m]["own_compile_s"] + modules[m]["shared_compile_s"]))
    return {
        "programs": len(programs), "compile_s": sum(p["s"] for p in programs.values()),
        "compiled_this_run": sum(p["compiled"] for p in programs.values()),
        "compiled_this_run_s": sum(p["s"] for p in programs.values() if p["compiled"]),
        "test_s": sum(test_s.values()),
        "by_function": {f: dict(c) for f, c in sorted(functions.items(), key=lambda kv: -kv[1]["compile_s"])[:12]},
        "modules": {m: {"test_s": test_s[m], "own_programs": modules[m]["own_programs"],
                        "own_compile_s": modules[m]["own_compile_s"],
                        "shared_compile_s": modules[m]["shared_compile_s"],
                        "compiled_this_run_s": modules[m]["compiled_this_run_s"]} for m in rows[:30]},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--logs", default=LOGS)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "suite_programs_cpu.json"))
    args = ap.parse_args()
    summary = summarize(args.logs)
    print(f"{summary['programs']} distinct programs, {summary['compile_s']:.0f} s to compile them "
          f"({summary['compiled_this_run']} compiled in this run, {summary['compiled_this_run_s']:.0f} s); "
          f"tests {summary['test_s']:.0f} worker-s")
    for m, r in summary["modules"].items():
        print(f"  {m:45s} tests {r['test_s']:6.1f} s  own {r['own_compile_s']:6.1f} s / {r['own_programs']:4d}  "
              f"shared {r['shared_compile_s']:5.1f} s  compiled this run {r['compiled_this_run_s']:5.1f} s")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results_io import write_result
    write_result({"platform": platform.platform(), "cpus": os.cpu_count(), **summary}, args.out)


if __name__ == "__main__":
    main()
