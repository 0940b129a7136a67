"""Multi-host runs through JAX's own distributed runtime (`jax.distributed`).

Every process runs the same program (SPMD). `initialize` connects the processes; the mesh
then spans all of their devices, weights are read shard by shard where they live, and
`dsjax.generate.generate_distributed` lets each process bring its own prompts and get its
own results.

Launching (one process per host; on GPU one process per host with all its GPUs, on TPU
one per TPU host):

    # explicit flags
    dsjax generate "..." --mesh data=2,expert=8 \\
        --coordinator host0:8476 --num-processes 2 --process-id $RANK
    # or the environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
    # (under SLURM / Open MPI / TPU pods JAX detects all three itself)

On CPU (tests, 2 local processes x 4 fake devices) the collectives run over gloo.
"""

from __future__ import annotations

import json
import os
import struct

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Connect this process to the others. Arguments override JAX_COORDINATOR_ADDRESS /
    JAX_NUM_PROCESSES / JAX_PROCESS_ID. Returns False (single process) when neither names
    a coordinator and no cluster environment is detected."""
    if jax.distributed.is_initialized():
        return True
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    clustered = any(k in os.environ for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"))
    if coordinator_address is None and not clustered:
        return False
    if (os.environ.get("JAX_PLATFORMS", "") or "cpu") == "cpu" or jax.config.jax_platforms == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    return True


def to_host(tree):
    """Device arrays -> numpy on every process (gathering shards held by other processes)."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def is_lead() -> bool:
    """The process that owns files (a batch job's output and manifest): process 0."""
    return jax.process_index() == 0


def broadcast_bytes(data: bytes | None) -> bytes:
    """Process 0's bytes on every process (the others pass None). One process: data as is."""
    if jax.process_count() == 1:
        return data
    lead = is_lead()
    size = np.frombuffer(struct.pack("<Q", len(data) if lead else 0), np.uint8)
    size = struct.unpack("<Q", np.asarray(multihost_utils.broadcast_one_to_all(size)).tobytes())[0]
    # one byte more: a zero-length array does not travel
    buf = np.frombuffer(data + b"\0", np.uint8) if lead else np.zeros(size + 1, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes()[:size]


def broadcast_json(obj):
    """Process 0's JSON-able value on every process (the others pass anything)."""
    if jax.process_count() == 1:
        return obj
    return json.loads(broadcast_bytes(json.dumps(obj).encode() if is_lead() else None))



def barrier(name: str) -> None:
    """Wait until every process gets here (one process: nothing to wait for)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
