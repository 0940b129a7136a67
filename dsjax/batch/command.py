"""`dsjax batch` and `dsjax verify`: the parsers and the commands. dsjax/cli/ registers
them (`add_parsers`) and hands over its helpers (loading with the command's flags, the
compile cache), so this file holds only what is particular to batch jobs."""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp

from dsjax.batch.job import JobRefused, Output, encode, finished, key
from dsjax.batch.manifest import (FORMAT, config_hash, differences, environment, manifest_path, model_name, read,
                                  weights_fingerprint, write)
from dsjax.batch.ray_data import dispatch, require_ray
from dsjax.batch.records import read_lines
from dsjax.batch.runner import check, effective_decode_steps, execute, make_engine
from dsjax.config import KERNELS
from dsjax.engine.prefix_cache import options_from_mib
from dsjax.sharding.distributed import barrier, broadcast_bytes, broadcast_json, initialize, is_lead
from dsjax.tokenizer import load_tokenizer
from dsjax.weights import DEFAULT_MODEL

BATCH_HELP = """\
Run every request of a JSONL file on one engine and write one JSON line per request.

Input lines: OpenAI batch requests ({"custom_id", "method": "POST", "url": "/v1/chat/completions"
or "/v1/completions", "body"}) or raw ones ({"id", "prompt": text | "prompt_ids": [...],
"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs", ...}). Output lines:
{"id", "seed", "text", "ids", "finish_reason", "usage", ...} or {"id", "error": {"line", "message"}}.

Crash-safe: each result is appended and fsync'd as it finishes; run the same command again
after a crash and it skips finished ids; a different setting is refused (<output>.manifest.json
records them). The finished output is in input order. Records without a seed get one from
--seed and their id, so results do not depend on the order records run in. Only with
--batch-invariant are they also bitwise independent of their batch neighbours: in the default
mode a row's logits may differ in the last bits between batch sizes, which can flip a
near-tie greedy token, so a resumed run may differ from an uninterrupted one.

Many hosts (a model too large for one): start the same command once per process with
--coordinator/--num-processes/--process-id (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID) and a --mesh over every process's devices. Process 0 reads the input and
writes the output and manifest; the output equals a one-process run's on the same mesh."""


def add_parsers(sub, common, *, load, setup_cache, compiling, prefix_cache_args) -> None:
    """`dsjax batch` and `dsjax verify` on the CLI's subparsers; load(args, say),
    setup_cache(args), compiling(say, cache), prefix_cache_args(parser) are the CLI's own helpers."""
    helpers = SimpleNamespace(load=load, setup_cache=setup_cache, compiling=compiling)
    b = sub.add_parser("batch", parents=[common], help="run a JSONL file of requests (crash-safe, resumable)",
                       description=BATCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--input", required=True, help="JSONL requests")
    b.add_argument("--output", required=True, help="JSONL results (and <output>.manifest.json)")
    b.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory, bundled model or named config")
    b.add_argument("--served-model-name", default=None, help="the model name OpenAI bodies may give (default: "
                   "the --model's last path component)")
    b.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    b.add_argument("--seed", type=int, default=0, help="run seed: records without a seed get one from it and their "
                   "id (and the init seed for named configs)")
    b.add_argument("--max-new-tokens", type=int, default=256, help="max_tokens of records that do not say")
    b.add_argument("--mesh", default="", help="device mesh, e.g. 'data=2,expert=4' (default: one device)")
    b.add_argument("--kernels", default="reference", choices=[*KERNELS, "auto"])
    b.add_argument("--max-slots", type=int, default=8, help="requests decoded at once")
    b.add_argument("--decode-steps", type=int, default=4, help="decode steps per dispatch")
    b.add_argument("--prefill-chunk", type=int, default=256)
    b.add_argument("--num-draft-tokens", type=int, default=0, metavar="K", help="speculative decoding: MTP drafts "
                   "verified per step (0 = off; the checkpoint needs its MTP layer)")
    b.add_argument("--batch-invariant", action="store_true", help="each record's logits bitwise independent of "
                   "its batch (a little slower): an interrupted and resumed job then equals an uninterrupted one "
                   "exactly, at any --max-slots")
    prefix_cache_args(b)
    b.add_argument("--record-routing", action="store_true", help="add each record's expert load to its line: "
                   '"expert_counts": {"prompt": [[n] * experts] * layers, "generated": ...}, the tokens each layer '
                   "routed to each expert (not with --num-draft-tokens or --prefix-cache-mb)")
    b.add_argument("--on-error", choices=["skip", "fail"], default="skip", help="bad input lines: write an error "
                   "line and go on (skip), or stop before running anything (fail, exit status 1)")
    b.add_argument("--ray", type=int, default=0, metavar="N", help="run on N model replicas with Ray Data (pip "
                   "install 'dsjax[ray]'): the cluster at RAY_ADDRESS, else a local one; same output file")
    b.add_argument("--ray-batch-size", type=int, default=0, metavar="B", help="records per Ray batch (default: "
                   "4 x --max-slots); a crash loses at most the batches running")
    b.add_argument("--ray-gpus", type=float, default=0, metavar="G", help="GPUs each replica reserves")
    b.add_argument("--coordinator", default=None, help="multi-host: coordinator host:port (jax.distributed); "
                   "default: $JAX_COORDINATOR_ADDRESS")
    b.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    b.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index (0 writes)")
    b.set_defaults(func=functools.partial(batch, helpers=helpers))

    v = sub.add_parser("verify", parents=[common], help="re-run a batch job's results and report ids that differ")
    v.add_argument("output", help="a dsjax batch output (its manifest sits beside it)")
    v.add_argument("--sample", type=int, default=0, metavar="N", help="re-run N random ids (default: all)")
    v.add_argument("--seed", type=int, default=0, help="seed of the sample")
    v.set_defaults(func=functools.partial(verify, helpers=helpers))


def _flag_settings(args, input_sha: str, name: str) -> dict:
    """The settings the flags and the input decide alone (checked on resume before the
    model is loaded)."""
    return {"model": model_name(args.model), "served_model_name": name, "mesh": args.mesh or "", "seed": args.seed,
            "max_new_tokens": args.max_new_tokens,
            "decode_steps": effective_decode_steps(args.decode_steps, args.num_draft_tokens),
            "prefill_chunk": args.prefill_chunk, "input_sha256": input_sha,
            **({"num_draft_tokens": args.num_draft_tokens} if args.num_draft_tokens else {}),  # absent: 0
            # the prompt chunks' grid (a hit itself changes no bit): absent when off
            **({"prefix_cache": True} if getattr(args, "prefix_cache_mb", 0) else {}),
            **({"record_routing": True} if getattr(args, "record_routing", False) else {})}  # a field of each line


def _settings(args, model, input_sha: str, name: str) -> dict:
    """Everything a result depends on that this job chooses (compared on resume and verify)."""
    return {**_flag_settings(args, input_sha, name), "config_hash": config_hash(model),
            "weights": weights_fingerprint(model, args.model), "dtype": jnp.dtype(model.dtype).name,
            "kernels": model.options.kernels,
            "batch_invariant": bool(args.batch_invariant or model.options.batch_invariant),
            "max_slots": args.max_slots}


def _refuse_other_settings(out: Path, recorded: dict, current: dict, only: set | None = None) -> None:
    """A resume must run with the settings its output was made with; only: compare these
    settings (and the environment), the rest are checked once the model is loaded."""
    if only is not None:
        recorded = {**recorded, "settings": {k: v for k, v in recorded.get("settings", {}).items() if k in only}}
    diffs = differences(recorded, current)
    if diffs:
        raise JobRefused(f"{out} was made with other settings ({'; '.join(diffs)}); run with the same ones "
                         f"to resume, or choose another --output")


def _prepare(args, say, helpers, data: bytes):
    """Load the model and check every line: (model, checked, engine, current settings)."""
    prefix_cache = options_from_mib(getattr(args, "prefix_cache_mb", 0), getattr(args, "prefix_host_mb", 0))
    cache = helpers.setup_cache(args)
    model = helpers.load(args, say, **({"mtp": True} if args.num_draft_tokens else {}))
    name = args.served_model_name or Path(args.model).name
    current = {"settings": _settings(args, model, hashlib.sha256(data).hexdigest(), name),
               "environment": environment()}
    checked = check(model, read_lines(data), tokenizer=load_tokenizer(args.model), name=name, seed=args.seed,
                    max_new_tokens=args.max_new_tokens)
    engine = make_engine(model, checked, max_slots=args.max_slots, batch_invariant=args.batch_invariant or None,
                         decode_steps=args.decode_steps, prefill_chunk=args.prefill_chunk,
                         num_draft_tokens=args.num_draft_tokens,
                         prefix_cache=prefix_cache, record_routing=getattr(args, "record_routing", False))
    helpers.compiling(say, cache)
    return checked, engine, current


def _refused(e: JobRefused) -> int:
    print(f"dsjax: error: {e}", file=sys.stderr)
    return 1


def batch(args, say, helpers) -> int:
    try:
        return _batch(args, say, helpers)
    except JobRefused as e:
        return _refused(e)


def _on_lead(fn):
    """fn() on process 0, which alone holds the output; its refusal is raised on every
    process (the others must stop exactly when it does, or they wait for it forever).
    Returns fn()'s value on process 0, None on the others."""
    if jax.process_count() == 1:
        return fn()
    value, refused = None, None
    if is_lead():
        try:
            value = fn()
        except (JobRefused, OSError) as e:
            refused = str(e)
    refused = broadcast_json(refused)
    if refused is not None:
        raise JobRefused(refused)
    return value


def _batch(args, say, helpers) -> int:
    """One process, or one of several (SPMD over a mesh spanning them all). Several: every
    process runs the same scheduler over the whole input - the same records admitted in the
    same order, the tokens read back gathered to every process - so all dispatch the same
    programs on the same host data, each feeding only its own devices' shards of it.
    Process 0 reads the input and the output (a resumed job's finished ids) and hands both
    to the others; it alone writes the output and manifest."""
    initialize(args.coordinator, args.num_processes, args.process_id)
    if jax.process_count() > 1 and not args.mesh:
        raise JobRefused(f"a {jax.process_count()}-process job needs a --mesh over all {jax.device_count()} devices, "
                         f"e.g. --mesh data={jax.process_count()},expert={jax.local_device_count()}")
    lead = is_lead()
    if not lead:
        say = _quiet
    inp, out = Path(args.input), Path(args.output)
    if args.ray < 0 or args.ray_batch_size < 0:
        raise JobRefused("--ray and --ray-batch-size must be >= 0")
    if args.ray and args.prefix_cache_mb:
        raise JobRefused("--prefix-cache-mb is not supported with --ray yet (each replica would need its own)")
    if args.record_routing and (args.num_draft_tokens or args.prefix_cache_mb):
        raise JobRefused("--record-routing is not supported with --num-draft-tokens or --prefix-cache-mb yet "
                         "(positions a verify step rejects or a cached block restores have no routing of their own)")
    if args.ray and jax.process_count() > 1:
        raise JobRefused("--ray runs replicas of one-process engines; it cannot be combined with a multi-process job")
    if args.ray:
        try:
            require_ray()
        except ImportError as e:
            raise JobRefused(f"--ray: {e}") from None
    mpath = manifest_path(out)

    def open_job():
        if out.exists() and out.resolve() == inp.resolve():
            raise JobRefused("--output is the --input file")
        data = inp.read_bytes()
        recorded = read(mpath) if mpath.exists() else None
        if recorded is None and out.exists() and out.stat().st_size:
            raise JobRefused(f"{out} exists and has no manifest ({mpath.name}): it was not written by dsjax batch; "
                             f"move it away or choose another --output")
        if recorded is not None:  # before minutes of loading and compiling
            flags = _flag_settings(args, hashlib.sha256(data).hexdigest(), args.served_model_name or
                                   Path(args.model).name)
            _refuse_other_settings(out, recorded, {"settings": flags, "environment": environment()}, set(flags))
        return data, recorded

    data, recorded = _on_lead(open_job) or (None, None)
    data = broadcast_bytes(data)
    t0 = time.perf_counter()
    checked, engine, current = _prepare(args, say, helpers, data)
    messages = checked.error_messages()

    def resume():
        if recorded is not None:
            _refuse_other_settings(out, recorded, current)
        for m in messages[:20]:
            say(f"{inp}: {m}")
        if messages and args.on_error == "fail":
            raise JobRefused(f"{len(messages)} bad input line(s), nothing was run (--on-error skip writes an error "
                             f"line for each and runs the rest): {messages[0]}")
        output = Output(out)
        done = output.recover()
        manifest = {"format": FORMAT, "complete": False, "input": str(inp.resolve()), "output": str(out.resolve()),
                    "records": len(checked.lines), "errors": len(checked.errors), **current}
        write(mpath, manifest)
        return output, done, manifest

    output, done, manifest = _on_lead(resume) or (None, {}, None)
    finished_ids = set(broadcast_json(sorted(done)))
    todo = [r for r in checked.records if key(r.id) not in finished_ids]
    say(f"{len(todo)} records to run ({len(checked.records) - len(todo)} finished before, "
        f"{len(checked.errors)} with errors)")

    def on_result(record, result):
        if lead:
            line = encode(result)
            output.append(line)
            done[key(record.id)] = line

    t = time.perf_counter()
    if args.ray and todo:
        tokens = _on_ray(args, data, engine.capacity, todo, output, done, say)
    else:
        tokens = execute(engine, todo, on_result, progress=False if args.quiet or not lead else None) if todo else 0
    seconds = time.perf_counter() - t
    if lead:
        output.finalize(checked, done)
        write(mpath, {**manifest, "complete": True})
    barrier("dsjax batch: output written")
    if engine is not None and engine.prefix is not None:
        m = engine.prefix_metrics()
        say(f"prefix cache: {m['hits']} of {m['lookups']} records hit, {m['prefill_tokens_saved']} prompt tokens "
            f"taken from it ({m['token_hit_rate']:.0%})")
    say(f"done: {len(checked.lines)} records ({len(todo)} run now, {len(checked.errors)} errors), {tokens} tokens "
        f"in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} tok/s; {time.perf_counter() - t0:.1f} s in all) "
        f"-> {out}")
    return 0


def _on_ray(args, data: bytes, capacity: int, todo, output: Output, done: dict, say) -> int:
    """Run the records still to do on args.ray replicas (each with this job's engine shape),
    appending each result as it comes back. Returns the tokens made."""
    objs = {n: obj for n, obj, _ in read_lines(data)}
    predictor = dict(model=model_name(args.model), dtype=args.dtype, seed=args.seed, mesh=args.mesh,
                     kernels=args.kernels, name=args.served_model_name or Path(args.model).name,
                     max_new_tokens=args.max_new_tokens, max_slots=args.max_slots,
                     batch_invariant=args.batch_invariant or None, decode_steps=args.decode_steps,
                     num_draft_tokens=args.num_draft_tokens, prefill_chunk=args.prefill_chunk, capacity=capacity,
                     record_routing=args.record_routing)
    say(f"dispatching to {args.ray} Ray replica(s) ...")
    tokens = 0
    lines = [(r.line, json.dumps(objs[r.line])) for r in todo]
    for _, rid, text in dispatch(lines, replicas=args.ray, batch_size=args.ray_batch_size or 4 * args.max_slots,
                                 predictor=predictor, num_gpus=args.ray_gpus, quiet=args.quiet):
        result = json.loads(text)
        if "error" in result:  # the driver checked every record with the same code: a replica differs
            raise RuntimeError(f"a Ray replica refused record {rid}: {result['error']['message']}")
        line = text.encode()
        output.append(line)
        done[key(result["id"])] = line
        tokens += len(result["ids"])
    return tokens


def _quiet(message: str) -> None:
    """say() on processes other than 0: their progress is process 0's."""


def verify(args, say, helpers) -> int:
    try:
        return _verify(args, say, helpers)
    except JobRefused as e:
        return _refused(e)


def _verify(args, say, helpers) -> int:
    out = Path(args.output)
    mpath = manifest_path(out)
    if not mpath.exists():
        raise JobRefused(f"no manifest {mpath}: only a dsjax batch output can be verified")
    recorded = read(mpath)
    s = recorded["settings"]
    job = argparse.Namespace(**vars(args))  # the CLI's common flags, and the recorded job's own
    job.__dict__.update(model=s["model"], served_model_name=s["served_model_name"], dtype=s["dtype"],
                        seed=s["seed"], mesh=s["mesh"], kernels=s["kernels"], batch_invariant=s["batch_invariant"],
                        max_new_tokens=s["max_new_tokens"], max_slots=s["max_slots"],
                        decode_steps=s["decode_steps"], prefill_chunk=s["prefill_chunk"],
                        num_draft_tokens=s.get("num_draft_tokens", 0),
                        prefix_cache_mb=256 if s.get("prefix_cache") else 0, prefix_host_mb=0,
                        record_routing=s.get("record_routing", False))
    data = Path(recorded["input"]).read_bytes()
    results = finished(out.read_bytes(), out)
    checked, engine, current = _prepare(job, say, helpers, data)
    diffs = differences(recorded, current)
    if diffs:
        raise JobRefused(f"cannot verify {out} here: {'; '.join(diffs)} (recorded -> here)")
    in_input = {key(r.id): r for r in checked.records}
    ids = [k for k in in_input if k in results] + [k for k in results if k not in in_input]
    chosen = random.Random(args.seed).sample(ids, args.sample) if 0 < args.sample < len(ids) else ids
    rerun = {}
    todo = [in_input[k] for k in chosen if k in in_input]
    if todo:
        execute(engine, todo, lambda r, result: rerun.__setitem__(key(r.id), encode(result)),
                progress=False if args.quiet else None)
    differ = [k for k in chosen if rerun.get(k) != results[k]]
    for k in differ:
        print(k)
    say(f"verified {len(chosen)} of {len(results)} results: {len(differ)} differ" +
        (f" ({', '.join(differ[:10])})" if differ else ""))
    return 1 if differ else 0
