"""What a CPU benchmark records about its machine: the CPU model and the vector features that
decide its products' speed (AVX2 / FMA, AVX-512, AVX512-BF16, AMX), and the load average
(a shared box's other work is part of every figure)."""

from __future__ import annotations

import os
import platform

FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_info(text: str | None = None) -> dict:
    """/proc/cpuinfo (or `text` in its format) -> {"model": name, "features": {flag: bool}}:
    the first processor's model name and whether its flags hold each of FEATURES."""
    if text is None:
        try:
            with open("/proc/cpuinfo") as f:
                text = f.read()
        except OSError:
            return {"model": platform.processor() or platform.machine(), "features": {}}
    model, flags = None, None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and flags is None:
            flags = set(value.split())
    return {"model": model or platform.processor() or platform.machine(),
            "features": {f: f in (flags or ()) for f in FEATURES}}


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (what `uptime` shows)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []
