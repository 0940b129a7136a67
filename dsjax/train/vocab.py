"""The training vocabulary: the full V4 vocabulary (129280) with every token the corpus
(almost) never uses tied to ONE shared row.

Tokens that occur at least `min_count` times in the training split each keep their own
embedding row; all others (about 110k of the 129280: other languages, rare words) share
one row u, embedding and (tied) output head alike. The model trained here is therefore a
full-vocabulary V4 model whose rare rows happen to be equal, and it trains as the same V4
model over a compact vocabulary of V_c = kept + 1 rows: `compact_config` is the config with
vocab_size V_c and tokens are renumbered by `to_compact`. Its softmax is the exact
full-vocabulary one: the n_shared identical logits h.u sum to exp(h.u + log n_shared), so
the shared column gets + log(n_shared) (`shared_bias`) and a target that is a shared token
costs log(n_shared) more (`full_nll`). The output head is what makes small V4 models slow
(129280 x hidden per token, twice with the MTP layer); the compact head is 5-7x cheaper.

`expand` turns compact parameters back into full-vocabulary ones (embedding rows and the
hash-routing table tid2eid gathered through `to_compact`): exact, the same function.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig


@dataclasses.dataclass(frozen=True, eq=False)
class VocabMap:
    kept: np.ndarray  # [V_c - 1] int32: full ids with their own row, sorted
    full_size: int

    def __eq__(self, other) -> bool:  # by value: equal maps share compiled training steps
        return isinstance(other, VocabMap) and self.full_size == other.full_size and np.array_equal(self.kept, other.kept)

    def __hash__(self) -> int:
        return hash((self.full_size, np.asarray(self.kept).tobytes()))

    @classmethod
    def from_counts(cls, counts: np.ndarray, min_count: int, always=(0,)) -> "VocabMap":
        keep = counts >= min_count
        keep[list(always)] = True  # BOS starts every document
        return cls(np.flatnonzero(keep).astype(np.int32), len(counts))

    @property
    def compact_size(self) -> int:
        return len(self.kept) + 1

    @property
    def shared(self) -> int:
        return len(self.kept)

    @property
    def n_shared(self) -> int:
        return self.full_size - len(self.kept)

    @property
    def to_compact(self) -> np.ndarray:
        """[full_size] int32: full id -> compact id (shared tokens -> the last row)."""
        out = np.full(self.full_size, self.shared, np.int32)
        out[self.kept] = np.arange(len(self.kept), dtype=np.int32)
        return out

    def shared_bias(self) -> jax.Array:
        """[V_c] added to compact logits: log(n_shared) on the shared column."""
        return jnp.zeros(self.compact_size, jnp.float32).at[-1].set(math.log(self.n_shared))


def compact_config(cfg: ModelConfig, vocab: VocabMap) -> ModelConfig:
    return dataclasses.replace(cfg, vocab_size=vocab.compact_size)


def full_nll(logits: jax.Array, targets: jax.Array, vocab: VocabMap) -> jax.Array:
    """Full-vocabulary -log p(target) from compact logits [..., V_c] (without the bias) and
    compact targets [...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) + vocab.shared_bias(), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return nll + jnp.where(targets == vocab.shared, math.log(vocab.n_shared), 0.0)


def expand(params, vocab: VocabMap):
    """Compact ModelParams -> full-vocabulary ModelParams (numpy leaves): embedding rows and
    hash tables indexed through `to_compact`."""
    idx = vocab.to_compact
    params = jax.tree.map(np.asarray, params)

    def tables(blocks):
        return tuple(tuple(b.replace(moe=b.moe.replace(tid2eid=b.moe.tid2eid[:, idx]))
                           if b.moe.tid2eid is not None else b for b in run) for run in blocks)

    out = params.replace(embed=params.embed[idx], blocks=tables(params.blocks))
    if params.lm_head is not None:
        out = out.replace(lm_head=params.lm_head[idx])
    return out
