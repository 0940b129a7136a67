"""How many bytes a device holds, and how many it still has free: the one place the weight
check (`dsjax.api.load_model`) and the cache check (`dsjax.engine.Engine`) ask.

CPU devices report no memory statistics; they share the host's RAM, so each of the
process's CPU devices is counted as an equal share of it.
"""

from __future__ import annotations

import jax


def _host_ram(total: bool) -> int:
    import psutil  # only CPU devices need it

    ram = psutil.virtual_memory()
    return ram.total if total else ram.available


def device_memory(device) -> int:
    """Bytes a device can hold: what it reports, or on CPU its share of the host's RAM."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return _host_ram(total=True) // max(1, len(jax.local_devices()))


def free_memory(device, devices_sharing_host: int = 1) -> int:
    """Bytes a device can still allocate: its limit less what is in use (the weights already
    loaded, for one), or on CPU the host's available RAM. `devices_sharing_host`: how many
    of the process's CPU devices the caller will fill at once (the host's RAM is theirs
    together; 1 for an allocation on one device, which may take all of it)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return _host_ram(total=False) // max(1, devices_sharing_host)


def show_bytes(n: float) -> str:
    """A byte count for a message: GiB from 1 GiB up, MiB below."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
