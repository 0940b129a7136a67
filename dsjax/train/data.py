"""The pretraining corpus: the Python standard library's own sources, tokenized with the
bundled DeepSeek-V4 tokenizer and packed into fixed-length sequences.

Corpus. Every `*.py` file under `sysconfig.get_paths()["stdlib"]` of the running
interpreter, except
  * third-party code: `site-packages/`, `dist-packages/`;
  * test suites: any directory named `test`, `tests` or `idle_test` (Lib/test alone is
    more than half of the stdlib's bytes, and mostly repetitive assertions);
  * generated tables: `encodings/` (charmap codecs) and `pydoc_data/` (one 0.7 MB string).
The list is PINNED in `stdlib_files.json` beside this file (`python -m dsjax.train.data
--write` regenerates it): sorted relative paths, each with its size and sha256, and the
interpreter version it was taken from. Reading checks every file against its pinned
hash, so a different interpreter fails loudly instead of training on other text.

Held-out files. A file is held out for evaluation iff the first 8 hex digits of
sha256(relative path) mod 20 == 0 (about 5 %): deterministic, independent of the file's
content and of the other files, and stable as the list grows.

Tokens. Each document is [BOS] + encode(text) (no EOS). The training documents, in an
order shuffled once by `seed`, are concatenated into one stream and cut into sequences of
seq_len + 1 tokens (inputs and next-token targets overlap by all but one; the tail that
does not fill a sequence is dropped). Sequences cross document boundaries; the BOS at each
document start marks them. Epoch e visits the sequences in the permutation
`default_rng([seed, e])`; the batch of step k is sequences k*B .. k*B + B - 1 of that
endless order, so a batch is a pure function of (file list, seed, seq_len, batch, step) and
resuming needs only the step. Held-out documents pack the same way, in pinned order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILE_LIST = Path(__file__).with_name("stdlib_files.json")
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
EXCLUDED_TOP = frozenset({"encodings", "pydoc_data"})
HELD_OUT_MODULUS = 20


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel_path: str) -> bool:
    return int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16) % HELD_OUT_MODULUS == 0


def scan_stdlib(root: Path) -> list[str]:
    """Sorted relative posix paths of the corpus files under root (rules in the docstring)."""
    out = []
    for d, dirs, files in os.walk(root):
        rel = Path(d).relative_to(root)
        dirs[:] = sorted(x for x in dirs if x not in EXCLUDED_DIRS and not (rel == Path(".") and x in EXCLUDED_TOP))
        out += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(out)


def file_list(root: Path, paths: list[str]) -> dict:
    """The pinned-list record of `paths` under root."""
    files = []
    for p in paths:
        data = (root / p).read_bytes()
        files.append({"path": p, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return {"python": platform.python_version(), "excluded_dirs": sorted(EXCLUDED_DIRS),
            "excluded_top": sorted(EXCLUDED_TOP), "held_out_rule": f"int(sha256(path)[:8], 16) % {HELD_OUT_MODULUS} == 0",
            "files": files}


def load_file_list(path: Path = FILE_LIST) -> dict:
    return json.loads(Path(path).read_text())


def read_documents(root: Path, listing: dict, *, held_out: bool) -> list[str]:
    """The texts of the listed training (or held-out) files, in pinned order, each checked
    against its pinned sha256."""
    texts = []
    for f in listing["files"]:
        if is_held_out(f["path"]) != held_out:
            continue
        data = (root / f["path"]).read_bytes() if (root / f["path"]).is_file() else None
        if data is None or hashlib.sha256(data).hexdigest() != f["sha256"]:
            raise ValueError(f"{root / f['path']}: {'missing' if data is None else 'differs from'} the pinned corpus "
                             f"file (Python {listing['python']}); this interpreter's stdlib is not the pinned one")
        texts.append(data.decode("utf-8", errors="replace"))
    return texts


def tokenize(texts: list[str], tokenizer) -> list[np.ndarray]:
    """Each document -> int32 [BOS] + encode(text)."""
    encoded = tokenizer._hf.encode_batch(texts, add_special_tokens=False)
    return [np.asarray([tokenizer.bos_id] + e.ids, np.int32) for e in encoded]


def pack(docs: list[np.ndarray], seq_len: int, seed: int | None) -> np.ndarray:
    """Documents (shuffled by seed; None keeps their order) concatenated and cut into
    [n, seq_len + 1] int32 sequences."""
    order = np.arange(len(docs)) if seed is None else np.random.default_rng(seed).permutation(len(docs))
    stream = np.concatenate([docs[i] for i in order]) if docs else np.zeros(0, np.int32)
    n = len(stream) // (seq_len + 1)
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)


@dataclass(frozen=True)
class Batches:
    """The endless, seeded batch order over packed sequences [n, seq_len + 1]."""

    sequences: np.ndarray
    batch: int
    seed: int

    def __post_init__(self):
        if len(self.sequences) < self.batch:
            raise ValueError(f"{len(self.sequences)} packed sequences cannot fill a batch of {self.batch}")

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.sequences))

    def indices(self, step: int) -> np.ndarray:
        """Sequence indices of step `step`'s batch (the position in the data is the step)."""
        n = len(self.sequences)
        flat = step * self.batch + np.arange(self.batch)
        epochs, offsets = flat // n, flat % n
        return np.asarray([self.epoch_order(int(e))[o] for e, o in zip(epochs, offsets)])

    def __call__(self, step: int) -> np.ndarray:
        return self.sequences[self.indices(step)]


def corpus_tokens(root: Path, listing: dict, tokenizer, cache_dir: Path | None = None):
    """-> (training docs, held-out docs) as token arrays, cached in cache_dir (keyed by the
    pinned list and the tokenizer file) so a resumed run does not tokenize again."""
    key = hashlib.sha256(json.dumps(listing, sort_keys=True).encode() + Path(tokenizer.path).read_bytes()).hexdigest()
    cache = None if cache_dir is None else Path(cache_dir) / f"corpus-{key[:16]}.npz"
    if cache is not None and cache.is_file():
        z = np.load(cache)
        split = lambda name: np.split(z[name], z[name + "_ends"][:-1])
        return split("train"), split("held_out")
    train = tokenize(read_documents(root, listing, held_out=False), tokenizer)
    held = tokenize(read_documents(root, listing, held_out=True), tokenizer)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp.npz")
        np.savez(tmp, train=np.concatenate(train), train_ends=np.cumsum([len(d) for d in train]),
                 held_out=np.concatenate(held), held_out_ends=np.cumsum([len(d) for d in held]))
        tmp.replace(cache)
    return train, held


def main():
    ap = argparse.ArgumentParser(description="write or check the pinned stdlib file list")
    ap.add_argument("--write", action="store_true", help=f"(re)write {FILE_LIST.name} from this interpreter")
    args = ap.parse_args()
    root = stdlib_root()
    if args.write:
        listing = file_list(root, scan_stdlib(root))
        FILE_LIST.write_text(json.dumps(listing, indent=1) + "\n")
    listing = load_file_list()
    held = [f for f in listing["files"] if is_held_out(f["path"])]
    print(f"{len(listing['files'])} files ({sum(f['bytes'] for f in listing['files']) / 1e6:.1f} MB) from Python "
          f"{listing['python']}, {len(held)} held out ({sum(f['bytes'] for f in held) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
