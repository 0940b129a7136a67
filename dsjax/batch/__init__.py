"""Offline batch jobs: a whole JSONL file of requests on one engine, durably.

    results = dsjax.batch.run(model, records)      # notebooks: dicts in, dicts out (input order)
    dsjax batch --input in.jsonl --output out.jsonl  # the command: crash-safe, resumable, with a manifest
    dsjax verify out.jsonl --sample 8               # re-run recorded ids, report any that differ
    dsjax batch ... --ray 4                         # on 4 model replicas with Ray Data (the `ray` extra)

records.py reads input lines (OpenAI batch style or raw), runner.py runs them, job.py keeps
the output file and its manifest, manifest.py says what a result depends on, command.py is
the CLI, ray_data.py runs batches on Ray Data replicas (`RayPredictor`; Ray itself is
imported only when a job uses it).
"""

from dsjax.batch.ray_data import RayPredictor
from dsjax.batch.records import Record, RecordError, derived_seed
from dsjax.batch.runner import run, run_items

__all__ = ["RayPredictor", "Record", "RecordError", "derived_seed", "run", "run_items"]
