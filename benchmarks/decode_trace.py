"""Where a CPU decode step's time goes inside the engine's own compiled program: the step is
traced with `jax.profiler` (XLA:CPU records every thunk it runs, per thread), each thunk is
matched to its HLO instruction in the compiled program, and the instruction to its op group
by the model's named scopes: embedding, DeepSeek-V4.1's engram, mhc, the three attention
kinds, moe, head, sampler, and layer_weights (a V4 scanned layer's weights copied out of
their stack where a product cannot read them in place); the rest is layer-loop control,
cache and slot bookkeeping. Unlike decode_profile.py, which times each group alone as a
program of its own, this splits the real fused step, and it says how much of the step both
cores were busy (XLA:CPU runs independent thunks side by side), how many thunks each group
runs, and which kinds of thunk (XLA's instruction names without their numbers: a dot, a
`copy_dot_fusion`, ...) take the time.

    python benchmarks/decode_trace.py [--batches 1 8] [--weight-dtype bfloat16] [--steps 30]
        [--out benchmarks/results/decode_trace_cpu.json]
    python benchmarks/decode_trace.py --prefill 128 [--weight-dtype bfloat16]
        (the prompt program instead: results/prefill_trace_cpu[_bf16_weights].json)

The tracer adds ~1 us a thunk (a step runs 1-5 thousand), so a traced step is a little
slower than the engine's untraced one (both reported). XLA:CPU only (it reads the CPU
runtime's thunk events).
"""

from __future__ import annotations

import collections
import glob
import os
import platform
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_profile import decoding_engine, step_args, step_model, step_seconds  # noqa: E402
from results_io import write_result  # noqa: E402

from dsjax.engine import Engine  # noqa: E402
from dsjax.engine.programs import decode_step, prefill_step  # noqa: E402
from dsjax.engine.sampler import SamplingParams  # noqa: E402

# the named scopes the model code puts its ops in (jax.named_scope); the outermost one names the group
GROUPS = ("embedding", "engram", "mhc", "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
          "moe", "head", "sampler", "layer_weights")  # layer_weights: a scanned layer's weights cut from the stack
OTHER = "other (layer loops, cache and slot bookkeeping)"
NOT_THUNKS = ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener")  # the runtime's own events
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = \S+ [\w-]+\((.*?)\)(.*)$", re.M)
OP_NAME = re.compile(r"metadata=\{op_name=\"([^\"]*)\"")
KIND = re.compile(r"\.\d+$")


def group_of(op_name: str) -> str:
    return next((part for part in op_name.split("/") if part in GROUPS), OTHER)


def instruction_groups(hlo_text: str) -> dict[str, str]:
    """Every instruction of a compiled program's HLO text -> its op group. An instruction XLA
    left without metadata (a rewritten dot) takes the group of its first operand that has one."""
    groups = {}
    for name, operands, rest in INSTRUCTION.findall(hlo_text):
        op_name = OP_NAME.search(rest)
        group = group_of(op_name.group(1)) if op_name else None
        if group is None or group == OTHER:
            inherited = (groups.get(o) for o in re.findall(r"%([\w.-]+)", operands))
            group = next((g for g in inherited if g not in (None, OTHER)), group or OTHER)
        groups[name] = group
    return groups


def thunk_self_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter, list]:
    """The XLA:CPU thunks of a jax.profiler trace -> (self nanoseconds per thunk name, calls per
    name, busy intervals): a thunk's time minus the thunks it ran inside it (a loop's body),
    summed over every thread."""
    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(path)
    self_ns, calls, busy = collections.Counter(), collections.Counter(), []
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):  # XLA's worker and client threads
                continue
            stack = []  # [end, name, time of the thunks inside]

            def close():
                end, name, inner, duration = stack.pop()
                if not name.startswith(NOT_THUNKS):
                    self_ns[name] += duration - inner
                    calls[name] += 1
                    busy.append((end - duration, end))

            for start, duration, name in sorted((e.start_ns, e.duration_ns, e.name) for e in line.events):
                while stack and stack[-1][0] <= start:
                    close()
                if stack:
                    stack[-1][2] += duration
                stack.append([start + duration, name, 0, duration])
            while stack:
                close()
    return self_ns, calls, busy


def union_ns(intervals) -> float:
    total, end = 0.0, -np.inf
    for s, e in sorted(intervals):
        if s > end:
            total, end = total + (e - s), e
        elif e > end:
            total, end = total + (e - end), e
    return total


def split(self_ns, calls, busy, hlo: str, runs: int) -> dict:
    """A trace's thunks (`thunk_self_times`) matched to the program's instructions and op groups,
    per run of the program."""
    groups = instruction_groups(hlo)
    per_group, unmatched = collections.Counter(), 0.0
    for name, ns in self_ns.items():
        if name in groups:
            per_group[groups[name]] += ns
        else:
            unmatched += ns
    thread_ns = sum(per_group.values())
    top = sorted(((ns, name) for name, ns in self_ns.items() if name in groups), reverse=True)[:12]
    thunks, kinds, kind_calls = collections.Counter(), collections.Counter(), collections.Counter()
    for name in self_ns:
        if name in groups:
            thunks[groups[name]] += calls[name]
            kind = KIND.sub("", name)  # XLA's names: <kind>.<number>, e.g. copy_dot_fusion.25
            kinds[kind] += self_ns[name]
            kind_calls[kind] += calls[name]
    return {
        "thread_s_per_step": {g: per_group[g] / 1e9 / runs for g in (*GROUPS, OTHER)},
        "thread_s_per_step_total": thread_ns / 1e9 / runs,
        "busy_s_per_step": union_ns(busy) / 1e9 / runs,  # at least one XLA thread running a thunk
        "unmatched_thread_s_per_step": unmatched / 1e9 / runs,  # not in the program (markers, other programs)
        "thunks_per_step": sum(calls[n] for n in self_ns if n in groups) / runs,
        "thunks_per_step_by_group": {g: thunks[g] / runs for g in (*GROUPS, OTHER)},
        "top_thunks": [{"name": n, "group": groups[n], "s_per_step": ns / 1e9 / runs,
                        "calls_per_step": calls[n] / runs} for ns, n in top],
        "top_thunk_kinds": [{"kind": k, "s_per_step": ns / 1e9 / runs, "calls_per_step": kind_calls[k] / runs}
                            for k, ns in kinds.most_common(12)],
    }


def traced(run) -> tuple:
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            seconds = run()
        return seconds, thunk_self_times(tmp)


def trace(model, batch: int, context: int, steps: int) -> dict:
    cfg = model.config
    engine = decoding_engine(model, batch, context, room=2 * steps + 64)
    untraced = step_seconds(engine, steps)
    length = int(np.max(np.asarray(engine.cache.length)))
    bucket = engine.scheduler.bucket(length + 1)  # the decode program of the traced steps' context bucket
    if engine.scheduler.bucket(length + steps) != bucket:
        raise ValueError(f"the traced steps would cross a context bucket ({bucket}): use a shorter --context or --steps")
    seconds, thunks = traced(lambda: step_seconds(engine, steps))
    # the same program the engine compiled (same arguments, same compiler): its instruction names
    hlo = decode_step.lower(engine.step_params, engine.cache, engine.slots, jnp.zeros(engine.rows, bool), cfg=cfg,
                            opts=engine.opts, ctx_bucket=bucket, n_logprobs=engine.logprob_width,
                            n_steps=engine.decode_steps).compile().as_text()
    return {"batch": batch, "context": context, "steps": steps, "engine_step_s": untraced, "traced_step_s": seconds,
            "tokens_per_s": batch / untraced, **split(*thunks, hlo, steps)}


def trace_prefill(model, length: int, runs: int) -> dict:
    """The engine's prompt program: a `length`-token prompt at batch 1 to its first token (one
    chunk), `runs` prompts traced; the program's arguments recorded from the engine's own call."""
    capacity = 256
    while capacity < 2 * length:
        capacity *= 2
    engine = Engine(model, max_slots=1, capacity=capacity, prefill_chunk=length)
    call, seen = engine.runner.call, {}

    def recording(fn, *args, **kw):
        if fn is prefill_step:
            seen["args"] = (args, kw)
        return call(fn, *args, **kw)

    engine.runner.call = recording
    rng = np.random.default_rng(0)

    def first_tokens(n):
        t = time.perf_counter()
        for _ in range(n):
            engine.generate([rng.integers(3, model.config.vocab_size, length).tolist()], SamplingParams(max_tokens=1))
        return (time.perf_counter() - t) / n

    first_tokens(2)
    untraced = first_tokens(runs)
    seconds, thunks = traced(lambda: first_tokens(runs))
    args, kw = seen["args"]
    hlo = prefill_step.lower(*args, **kw).compile().as_text()
    return {"prompt_tokens": length, "runs": runs, "engine_first_token_s": untraced, "traced_first_token_s": seconds,
            "prefill_tokens_per_s": length / untraced, **split(*thunks, hlo, runs)}


def show(r: dict, what: str, wall: float) -> None:
    print(f"{what}: {wall * 1e3:.2f} ms traced; {r['thunks_per_step']:.0f} thunks; XLA threads busy "
          f"{r['thread_s_per_step_total'] * 1e3:.2f} thread-ms (mean {r['thread_s_per_step_total'] / wall:.2f} cores "
          f"of {os.cpu_count()}), none busy {max(wall - r['busy_s_per_step'], 0) * 1e3:.2f} ms")
    for g, s in sorted(r["thread_s_per_step"].items(), key=lambda kv: -kv[1]):
        print(f"  {g:50s} {s * 1e3:7.3f} thread-ms  {s / r['thread_s_per_step_total']:5.1%}  "
              f"{r['thunks_per_step_by_group'][g]:5.0f} thunks")
    print("  thunk kinds:", ", ".join(f"{k['kind']} {k['s_per_step'] * 1e6:.0f} us / {k['calls_per_step']:.0f}"
                                      for k in r["top_thunk_kinds"][:8]))


def main():
    ap = step_args(__doc__, "decode_trace_cpu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prefill", type=int, metavar="TOKENS",
                    help="trace the prompt program instead: a TOKENS-token prompt at batch 1 to its first token "
                         "(default out: results/prefill_trace_cpu[_bf16_weights].json)")
    args = ap.parse_args()
    if args.prefill:
        args.stem = "prefill_trace_cpu"
    model, out = step_model(args)
    runs = []
    if args.prefill:
        r = trace_prefill(model, args.prefill, max(4, args.steps // 4))
        runs.append(r)
        print(f"prefill of {args.prefill} tokens: engine {r['engine_first_token_s'] * 1e3:.2f} ms to the first token "
              "untraced")
        show(r, "prompt program", r["traced_first_token_s"])
    for b in [] if args.prefill else args.batches:
        r = trace(model, b, args.context, args.steps)
        runs.append(r)
        print(f"batch {b}: engine step {r['engine_step_s'] * 1e3:.2f} ms untraced")
        show(r, "step", r["traced_step_s"])
    write_result({"config": model.config.name, "weight_dtype": args.weight_dtype, "jax": jax.__version__,
                  "device": str(jax.devices()[0]), "cpus": os.cpu_count(), "platform": platform.platform(),
                  "runs": runs}, out)


if __name__ == "__main__":
    main()
