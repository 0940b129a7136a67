"""Writes benchmarks/REPORT.md from the JSON under benchmarks/results/: one table per result file.

    python benchmarks/report.py            # rewrite REPORT.md
    python benchmarks/report.py --check    # exit 1 if REPORT.md is not what the JSON gives

The JSON is the record; REPORT.md is only a view of it, so it is generated, never edited by
hand (tests/test_report.py checks the committed file equals a fresh render). The render is
deterministic: files in name order, keys in the JSON's order, numbers to 4 significant digits.

Each result file's table is found generically: its largest collection of records (a dict of
dicts or a list of dicts: batches, runs, kernels, layouts, ...) becomes the table, records as
columns when there are few of them and as rows otherwise; the file's other plain fields (the
machine, the versions, the settings) are listed above it. Values left out of a table to keep
it readable (long lists, long notes, columns past the cap) are counted under it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
REPORT = os.path.join(HERE, "REPORT.md")

# result file name prefix -> the script that writes it (longest prefix wins)
SCRIPTS = {
    "ab_decode": "ab_decode.py", "compile": "compile_bench.py", "constrained": "constrained_bench.py",
    "decode_profile": "decode_profile.py", "decode_trace": "decode_trace.py", "engine_cpu": "engine_bench.py",
    "engram_transfer": "engram_transfer.py", "ep": "ep_bench.py", "gpu_check": "gpu_check.py",
    "gpu_engine": "gpu_engine.py", "gpu_run": "gpu_engine.py", "grammar": "grammar_bench.py", "head_kernel": "head_kernel.py",
    "head_layout": "head_layout.py", "host_share": "host_share.py", "indexer": "indexer_bench.py", "invariance": "invariance_bench.py",
    "layer_calls": "rows_kernel.py", "layer_layout": "layer_layout.py", "llamacpp": "llamacpp/run.sh", "load": "load_bench.py", "logits_lengths": "logits_lengths.py", "suite_programs": "suite_programs.py", "prefix_cache": "prefix_cache_bench.py",
    "prefill_trace": "decode_trace.py", "program_identity": "program_identity.py", "rows_kernel": "rows_kernel.py",
    "sampler": "sampler_bench.py", "serve_trial": "serve_trial.py",
    "sinkhorn_forms": "sinkhorn_forms.py", "spec": "spec_bench.py", "tinypy_report": "tinypy_report.py",
    "tpu_roofline": "tpu_roofline.py",
}
MACHINE_KEYS = ("machine", "platform", "device", "devices", "backend", "cpus")
MAX_STRING = 100      # longer strings are cut (the JSON keeps them whole)
MAX_LIST = 6          # longer lists of numbers are left out of tables
MAX_ROWS = 64         # rows of one table
MAX_COLS = 12         # columns of a table whose records are its rows
FEW_RECORDS = 6       # at most this many records: one column each


def fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return str(v)
        return f"{v:.4g}"
    if isinstance(v, int):
        return str(v)
    if v is None:
        return ""
    if isinstance(v, list):
        return ", ".join(fmt(x) for x in v)
    s = " ".join(str(v).split())
    if len(s) > MAX_STRING:
        s = s[: MAX_STRING - 1] + "…"
    return s.replace("|", "\\|")


def is_leaf(v) -> bool:
    if isinstance(v, list):
        return len(v) <= MAX_LIST and all(not isinstance(x, (dict, list)) for x in v)
    return not isinstance(v, dict)


def leaves(d, prefix="", out=None, skipped=None):
    """Flattened (path, value) pairs of a JSON value; unrenderable ones counted in skipped[0]."""
    out = [] if out is None else out
    skipped = [0] if skipped is None else skipped
    if isinstance(d, dict):
        for k, v in d.items():
            leaves(v, f"{prefix}.{k}" if prefix else str(k), out, skipped)
    elif isinstance(d, list) and not is_leaf(d):
        if all(isinstance(x, dict) for x in d) and len(d) <= MAX_LIST:
            for i, x in enumerate(d):
                leaves(x, f"{prefix}[{i}]", out, skipped)
        else:
            skipped[0] += 1
    else:
        out.append((prefix, d))
    return out, skipped


def records(v):
    """-> [(label, record dict)] if v is a collection of records, else None."""
    if isinstance(v, dict) and len(v) >= 2 and all(isinstance(x, dict) for x in v.values()):
        return [(str(k), x) for k, x in v.items()]
    if isinstance(v, list) and len(v) >= 2 and all(isinstance(x, dict) for x in v):
        out = []
        for i, x in enumerate(v):
            first = next(((k, y) for k, y in x.items() if not isinstance(y, (dict, list))), None)
            out.append((f"{first[0]} {fmt(first[1])}" if first else str(i), x))
        return out
    return None


def expand(recs):
    """Records made of records ({batch: {engine: {...}}}) -> one record per (outer, inner) pair,
    labelled "outer / inner", so the table has a row per leaf record; an outer record's own
    plain fields stay as a row of their own, labelled by it."""
    def nested(r):
        return isinstance(r, dict) and sum(isinstance(v, dict) for v in r.values()) >= max(2, len(r) - 1)

    while recs and all(nested(r) for _, r in recs) and sum(len(r) for _, r in recs) <= MAX_ROWS:
        out = []
        for label, r in recs:
            plain = {k: v for k, v in r.items() if not isinstance(v, dict)}
            if plain:
                out.append((label, plain))
            out += [(f"{label} / {k}", v) for k, v in r.items() if isinstance(v, dict)]
        recs = out
    return recs


def main_collection(d: dict):
    """The key of the top-level (or second-level) collection of records holding most values."""
    best, best_n = None, 0
    for k, v in d.items():
        cands = [((k,), v)] + ([((k, k2), v2) for k2, v2 in v.items()] if isinstance(v, dict) else [])
        for path, c in cands:
            recs = records(c)
            if recs:
                n = sum(len(leaves(r)[0]) for _, r in recs)
                if n > best_n:
                    best, best_n = path, n
    return best


def table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def roofline_tables(d: dict) -> list[str]:
    """tpu_roofline.json's tables: the chips' figures, each kernel call's expected time per
    generation (its bound), the decode step per slice (also docs/kernels.md's tables)."""
    gens = list(d["chips"])
    keys = [k for k in d["chips"][gens[0]] if k != "source"]
    lines = table(["chip"] + keys + ["source"], [[g] + [fmt(c[k]) for k in keys] + [c["source"]]
                                                 for g, c in d["chips"].items()])
    lines += ["", f"Kernel calls ({d['model']} shapes): MB and GFLOP per call (at {gens[0]}'s blocks), "
              "expected us per generation (bound).", ""]
    lines += table(["kernel", "shape", "MB", "GFLOP"] + [f"{g} us" for g in gens],
                   [[r["kernel"], r["shape"], fmt(r[gens[0]]["mbytes"]), fmt(r[gens[0]]["gflop"])]
                    + [f"{fmt(r[g]['expected_us'])} ({r[g]['bound']})" for g in gens] for r in d["kernels"]])
    cols = [k for k in d["decode_step"][0] if k != "slice"]
    lines += ["", f"One {d['model']} decode step per device (mesh expert=8).", ""]
    lines += table(["slice"] + cols, [[r["slice"]] + [fmt(r[k]) for k in cols] for r in d["decode_step"]])
    return lines


# result file name prefix -> its own renderer (the tables after the heading and source line)
RENDERERS = {"tpu_roofline": roofline_tables}


def render_file(name: str, d) -> list[str]:
    stem = name[: -len(".json")]
    script = max((p for p in SCRIPTS if stem.startswith(p)), key=len, default=None)
    lines = [f"## {stem}", ""]
    src = f"[`results/{name}`](results/{name})"
    lines.append(f"From {src}" + (f", written by `benchmarks/{SCRIPTS[script]}`." if script else "."))
    lines.append("")
    own = next((r for p, r in RENDERERS.items() if stem.startswith(p)), None)
    if own is not None:
        return lines + [f"{d['note']}.", ""] * ("note" in d) + own(d) + [""]
    if not isinstance(d, dict):
        d = {"value": d}
    path = main_collection(d)
    main = d
    for k in path or ():
        main = main[k]
    # the plain fields outside the table: machine first, then the rest in the JSON's order
    outside = dict(d)
    if path:
        if len(path) == 1:
            outside.pop(path[0])
        else:
            outside[path[0]] = {k: v for k, v in outside[path[0]].items() if k != path[1]}
    flat, skipped = leaves(outside)
    machine = [(p, v) for p, v in flat if p.split(".")[0] in MACHINE_KEYS]
    rest = [(p, v) for p, v in flat if p.split(".")[0] not in MACHINE_KEYS]
    if machine:
        lines.append("Machine: " + "; ".join(f"{p} `{fmt(v)}`" for p, v in machine) + ".")
        lines.append("")
    left_out = skipped[0]
    if path:
        for p, v in rest[:MAX_ROWS]:
            lines.append(f"- {p}: {fmt(v)}")
        left_out += max(0, len(rest) - MAX_ROWS)
        if rest:
            lines.append("")
        recs = expand(records(main))
        cols, per = [], []
        for label, r in recs:
            fl, sk = leaves(r)
            left_out += sk[0]
            per.append((label, dict(fl)))
            for p, _ in fl:
                if p not in cols:
                    cols.append(p)
        # plain numbers and words first: the lists (every repeat's timing) are the first to go
        cols.sort(key=lambda c: any(isinstance(vals.get(c), list) for _, vals in per))
        lines.append(f"Table: `{'.'.join(path)}`.")
        lines.append("")
        if len(recs) <= FEW_RECORDS:
            shown = cols[:MAX_ROWS]
            left_out += (len(cols) - len(shown)) * len(recs)
            rows = [[c] + [fmt(vals.get(c)) for _, vals in per] for c in shown]
            lines += table([""] + [fmt(label) for label, _ in per], rows)
        else:
            shown = cols[:MAX_COLS]
            left_out += (len(cols) - len(shown)) * len(recs)
            rows = [[fmt(label)] + [fmt(vals.get(c)) for c in shown] for label, vals in per[:MAX_ROWS]]
            left_out += max(0, len(per) - MAX_ROWS) * len(shown)
            lines += table([""] + shown, rows)
    else:
        rows = [[p, fmt(v)] for p, v in rest[:MAX_ROWS]]
        left_out += max(0, len(rest) - MAX_ROWS)
        lines += table(["field", "value"], rows)
    if left_out:
        lines += ["", f"({left_out} more values in the JSON.)"]
    lines.append("")
    return lines


def render(results_dir: str = RESULTS) -> str:
    names = sorted(n for n in os.listdir(results_dir) if n.endswith(".json"))
    lines = [
        "# Benchmark report",
        "",
        "Generated by `python benchmarks/report.py` from the JSON in `benchmarks/results/`; do not edit by",
        "hand. One table per result file, as its last run left it: the machine each ran on is named",
        "under its heading. Figures from different machines, or from a shared machine at different",
        "times, are not comparable with each other. How each benchmark is run and what it measures:",
        "the script's docstring and [docs/](../docs/index.md).",
        "",
        "Contents: " + ", ".join(f"[{n[:-5]}](#{n[:-5].lower()})" for n in names) + ".",
        "",
    ]
    for n in names:
        with open(os.path.join(results_dir, n)) as f:
            lines += render_file(n, json.load(f))
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if REPORT.md is out of date")
    ap.add_argument("--out", default=REPORT)
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        try:
            with open(args.out, encoding="utf-8") as f:
                same = f.read() == text
        except FileNotFoundError:
            same = False
        if not same:
            print(f"{args.out} is out of date: run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
