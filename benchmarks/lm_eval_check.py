"""lm-evaluation-harness end to end against `dsjax serve`, checked against `dsjax.score`.

Starts `dsjax serve --max-logprobs 5` (the built-in model) in a subprocess, runs lm-eval's
`local-completions` on two local tasks of 20 items (a multiple-choice task and a
`loglikelihood_rolling` perplexity task, written here as JSON + YAML), then recomputes every
item's log-likelihood with `dsjax.score` on the token ids lm-eval sent (its own split of
context and continuation; its prefix token for the rolling windows) and records the largest
difference. lm-eval is not a dsjax dependency: install it in its own environment,

    python -m venv --system-site-packages /tmp/lmeval && /tmp/lmeval/bin/pip install "lm_eval[api]==0.4.13"
    python benchmarks/lm_eval_check.py --lm-eval /tmp/lmeval/bin/lm_eval

Output: benchmarks/results/lm_eval_cpu.json (lm-eval's scores, the per-item comparison,
timings). Exit status 1 when an item differs by more than --tolerance (1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dsjax  # noqa: E402

# 20 multiple-choice items for a Python code model: which line completes the function
MC = [("def add(a, b):\n    return a", [" + b", " - b", " * b", " / b"], 0),
      ("def is_even(n):\n    return n %", [" 2 == 0", " 3 == 1", " 5", " n"], 0),
      ("for i in range(", ["10):", "10]", "10}", "10>"], 0),
      ("import", [" os", " (", " 3", " ="], 0),
      ("def square(x):\n    return x", [" * x", " + 1", " - x", " ** 0"], 0),
      ("if x is None:\n   ", [" return", " import", " class", " def def"], 0),
      ("with open(path) as", [" f:", " 3:", " (:", " ]:"], 0),
      ("print(\"hello", ["\")", "\"]", "')", ")\""], 0),
      ("class Stack:\n    def __init__(self", ["):", "]:", "}:", ")]"], 0),
      ("try:\n    x = 1\nexcept", [" ValueError:", " return", " for", " ="], 0),
      ("def mean(xs):\n    return sum(xs) /", [" len(xs)", " xs", " 0", " sum"], 0),
      ("numbers = [1, 2, 3]\nfor n in", [" numbers:", " 3:", " def:", " (:"], 0),
      ("while True:\n   ", [" break", " def", " class", " import"], 0),
      ("def greet(name):\n    return \"Hello, \" +", [" name", " 3", " def", " ]"], 0),
      ("x = [i * i for i in", [" range(10)]", " 10)", " def]", " (]"], 0),
      ("def first(xs):\n    return xs[", ["0]", "0)", "0}", "]]"], 0),
      ("return", [" None", " def", " class", " import"], 0),
      ("self.items.append(", ["item)", "item]", "item}", ")("], 0),
      ("lambda x:", [" x + 1", " def", " class", " import"], 0),
      ("assert", [" x == 1", " def", " class", " import"], 0)]
# 20 snippets for perplexity
PPL = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
       "import os\nimport sys\n",
       "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
       "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
       "with open('data.txt') as f:\n    lines = f.readlines()\n", "x = [i * i for i in range(5)]\n",
       "def is_prime(n):\n    for d in range(2, n):\n        if n % d == 0:\n            return False\n"
       "    return True\n",
       "try:\n    value = int(text)\nexcept ValueError:\n    value = 0\n", "print('hello world')\n",
       "def mean(xs):\n    return sum(xs) / len(xs)\n", "while n > 0:\n    n -= 1\n",
       "result = {k: v for k, v in pairs}\n", "def reverse(s):\n    return s[::-1]\n",
       "if __name__ == '__main__':\n    main()\n", "total = 0\nfor x in xs:\n    total += x\n",
       "def square(x):\n    return x * x\n", "names = sorted(names, key=len)\n",
       "def greet(name):\n    return f'Hello, {name}!'\n", "assert add(2, 3) == 5\n"]

TASKS = {
    "dsjax_mc": """task: dsjax_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "dsjax_ppl": """task: dsjax_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/ppl.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tasks(directory: Path) -> None:
    with open(directory / "mc.jsonl", "w") as f:
        for context, choices, label in MC:
            f.write(json.dumps({"context": context, "choices": choices, "label": label}) + "\n")
    with open(directory / "ppl.jsonl", "w") as f:
        for text in PPL:
            f.write(json.dumps({"text": text}) + "\n")
    for name, yaml in TASKS.items():
        (directory / f"{name}.yaml").write_text(yaml.format(dir=directory))


def lm_eval_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair` with the remote tokenizer (encode without BOS)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable")
    ap.add_argument("--tolerance", type=float, default=1e-5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/lm_eval_cpu.json"))
    args = ap.parse_args()

    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="dsjax_lmeval_"))
    write_tasks(work)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "dsjax", "serve", "--port", str(port), "--max-logprobs", "5",
                               "--capacity", "1024", "--quiet"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                print(server.stdout.read())
                raise SystemExit("dsjax serve stopped before it was ready")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        ready_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        # custom_prefix_token_id=0: the rolling windows start from BOS (lm-eval's remote tokenizer
        # takes `bos_token_id or eos_token_id`, and BOS is id 0)
        cmd = [args.lm_eval, "--model", "local-completions", "--model_args",
               f"model=dsjax-tiny-py,base_url={url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,"
               f"max_retries=1,custom_prefix_token_id=0",
               "--tasks", "dsjax_mc,dsjax_ppl", "--include_path", str(work), "--batch_size", "1",
               "--log_samples", "--output_path", str(work / "out")]
        run = subprocess.run(cmd, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "unused"},
                             capture_output=True, text=True)
        eval_s = time.perf_counter() - t1
        if run.returncode:
            print(run.stdout[-4000:], run.stderr[-8000:])
            raise SystemExit(f"lm_eval exited {run.returncode}")
    finally:
        server.terminate()
        server.wait(30)

    results = json.loads(next((work / "out").rglob("results_*.json")).read_text())
    samples = {task: [json.loads(line) for line in next((work / "out").rglob(f"samples_{task}_*.jsonl")).open()]
               for task in TASKS}
    model, tok = dsjax.load_model(), dsjax.load_tokenizer()
    items = []
    for s in sorted(samples["dsjax_mc"], key=lambda s: s["doc_id"]):
        args_ = s["arguments"]  # saved as {"gen_args_i": {"arg_0": context, "arg_1": continuation}}
        args_ = [args_[f"gen_args_{i}"] for i in range(len(args_))] if isinstance(args_, dict) else args_
        pairs = [lm_eval_pair(tok, *((a["arg_0"], a["arg_1"]) if isinstance(a, dict) else a[:2])) for a in args_]
        scores = dsjax.score(model, [c for c, _ in pairs], [t for _, t in pairs])
        for (ll, greedy), sc in zip((r[0] for r in s["resps"]), scores):
            items.append({"task": "dsjax_mc", "doc": s["doc_id"], "lm_eval": float(ll), "dsjax_score": sc.logprob,
                          "lm_eval_greedy": bool(greedy) if not isinstance(greedy, str) else greedy == "True",
                          "dsjax_greedy": sc.is_greedy})
    texts = [json.loads(line)["text"] for line in (work / "ppl.jsonl").open()]
    rolled = dsjax.score(model, [[0] + tok.encode(t) for t in texts])
    for s in sorted(samples["dsjax_ppl"], key=lambda s: s["doc_id"]):
        ll = s["resps"][0][0]
        items.append({"task": "dsjax_ppl", "doc": s["doc_id"], "lm_eval": float(ll),
                      "dsjax_score": rolled[s["doc_id"]].logprob})
    diff = max(abs(i["lm_eval"] - i["dsjax_score"]) for i in items)
    greedy_agree = all(i["lm_eval_greedy"] == i["dsjax_greedy"] for i in items if "dsjax_greedy" in i)
    out = {"what": "lm-eval 0.4.13 local-completions against dsjax serve (built-in model), per-item "
                   "log-likelihoods against dsjax.score on the same token ids",
           "command": " ".join(cmd[:1] + ["..."] + cmd[1:]), "lm_eval_results": results["results"],
           "items": len(items), "max_abs_diff": diff, "tolerance": args.tolerance, "greedy_agree": greedy_agree,
           "server_ready_s": round(ready_s, 1), "lm_eval_s": round(eval_s, 1), "per_item": items,
           "versions": {"lm_eval": results.get("lm_eval_version") or results.get("config", {}).get("lm_eval_version"),
                        "jax": __import__("jax").__version__, "dsjax": dsjax.__version__}}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "per_item"}, indent=1))
    return 0 if diff <= args.tolerance and greedy_agree else 1


if __name__ == "__main__":
    sys.exit(main())
