"""Checkpoints that ship inside the package, loadable by name.

    dsjax.load_model()                  # the default: DEFAULT_MODEL
    dsjax.load_model("dsjax-tiny-py")   # the same, by name

`dsjax-tiny-py` is a small DeepSeek-V4 model (4 layers: sliding window, CSA with the
Lightning Indexer, HCA; hash and top-k MoE; mHC; one MTP layer) trained on the Python
standard library's own sources (dsjax/train/, report in benchmarks/results/tinypy_report.json).
It is stored in DeepSeek's format (FP8 E4M3 linears with E8M0 block scales, MXFP4 routed
experts), so the default model goes through the same loader as V4-Flash.

Each bundled model is a directory `dsjax/weights/<name>/` holding config.json and
model.safetensors (and, optionally, draft_vocab.json: the token ids its MTP drafter may
propose, see dsjax/engine/speculative.py).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "dsjax-tiny-py"

_ROOT = Path(__file__).resolve().parent


def bundled_models() -> list[str]:
    """Names of the checkpoints shipped with dsjax."""
    return sorted(p.name for p in _ROOT.iterdir() if (p / "config.json").is_file() and any(p.glob("*.safetensors")))


def bundled_path(name: str) -> Path | None:
    """The directory of the bundled checkpoint `name`, or None when there is none."""
    if not isinstance(name, str) or "/" in name or name.startswith("."):
        return None
    p = _ROOT / name
    return p if (p / "config.json").is_file() and any(p.glob("*.safetensors")) else None


def resolve(name_or_path: str | Path) -> str | Path:
    """A bundled model's name -> its directory (a path that exists on disk wins); anything
    else unchanged."""
    if Path(name_or_path).exists():
        return name_or_path
    found = bundled_path(str(name_or_path))
    return found if found is not None else name_or_path
