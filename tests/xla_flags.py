"""XLA_FLAGS for the processes the suite starts: their own number of fake CPU devices, the
suite's other flags kept (tests/conftest.py), so their programs compile as the suite's do."""

import os

DEVICES = "--xla_force_host_platform_device_count"


def device_flags(n: int) -> str:
    """This process's XLA_FLAGS with `n` fake CPU devices instead of its own count."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICES)]
    return " ".join(kept + [f"{DEVICES}={n}"])
