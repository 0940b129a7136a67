"""The pretraining objective of a V4 model, on the model's own functions (dsjax.model):

    L = CE(main head, x_{t+1})  +  lambda_mtp * CE(MTP layer, x_{t+2})  +  lambda_idx * L_I

* Next-token cross-entropy of `logits_of(decoder_streams(...))` at every position t < S.
* MTP (DeepSeek-V3 section 2.2, V4 keeps one depth): at position t the MTP layer sees the
  main model's final streams X_t and the embedding of x_{t+1} and predicts x_{t+2}; its
  cross-entropy is weighted by lambda_mtp (V3: 0.3, then 0.1) and, as in V3, its gradient
  reaches the main model (streams, shared embedding and head).
* Lightning Indexer distillation (DeepSeek-V3.2 section 2.1): on every CSA layer the
  indexer's score distribution over the visible compressed entries is pulled towards the
  main attention's, KL(p_t || softmax(I_t)), where p_t is the main attention's probability
  of each compressed entry, summed over heads and L1-normalised over the entries (the mass
  on window keys and the sink cancels in that normalisation). The indexer's inputs (the
  layer input h and the shared query latent cq) and the target are detached: the indexer
  learns only from L_I and the main model only from the LM losses. V3.2's dense warm-up
  computes the target over all entries; its sparse stage restricts it to the selected set
  S_t. A model trained from scratch here is sparse from step 0, so the target is taken over
  ALL visible entries (what the main attention would assign to each, selected or not): an
  unselected entry the main attention would want still pulls the indexer towards it.
  Top-k selection itself has no gradient (integer indices); nothing else trains the
  indexer, so without L_I its weights would stay at their initialisation.

Losses average over real positions (`mask`): the last position has no x_{t+2} target.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.config import LayerSpec, ModelConfig
from dsjax.layers.attention import Attention, compressed_visible, project_q
from dsjax.layers.compressor import compress_kv
from dsjax.layers.indexer import index_queries, index_scores, index_weights
from dsjax.layers.rope import rope_cos_sin
from dsjax.model import decoder_streams_probed, logits_of, mtp_forward, mtp_head
from dsjax.model.v4.decoder import ModelParams
from dsjax.model.v4.mtp import MTPParams
from dsjax.train.vocab import VocabMap, full_nll


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array, vocab: VocabMap | None = None) -> jax.Array:
    """Mean -log p(target) over mask. logits [..., V] fp32, targets / mask [...]. With
    `vocab` the logits and targets are compact and the loss is the full vocabulary's
    (dsjax/train/vocab.py)."""
    if vocab is None:
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    else:
        nll = full_nll(logits, targets, vocab)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def indexer_distillation(layer: LayerSpec, p: Attention, h: jax.Array, positions: jax.Array,
                         cfg: ModelConfig) -> jax.Array | None:
    """A CSA layer's KL(main attention over compressed entries || indexer), mean over the
    queries that see at least one entry (None on layers without an indexer). Used as the
    `probe` of `decoder_streams_probed`: h [B, S, D] is the layer's normed attention input."""
    if not layer.has_indexer:
        return None
    h = jax.lax.stop_gradient(h)
    main = jax.lax.stop_gradient(p.replace(indexer=None))
    m = layer.compress_ratio
    cos, sin = rope_cos_sin(positions, cfg.rope(layer.rope), cfg.qk_rope_head_dim)
    cq, q = project_q(main, h, cos, sin, cfg)  # [B, S, q_lora], [B, S, H, hd]
    entries = compress_kv(main.compressor, h, ratio=m, overlap=True, cfg=cfg)  # [B, E, hd]
    n = entries.shape[1]
    if n == 0:
        return jnp.zeros((), jnp.float32)
    visible = compressed_visible(positions, n, m)  # [B, S, E]
    logits = jnp.einsum("bshd,bed->bshe", q, entries, preferred_element_type=jnp.float32) * cfg.head_dim ** -0.5
    probs = jax.nn.softmax(jnp.where(visible[:, :, None], logits, -jnp.inf), axis=-1)
    target = jnp.nan_to_num(jnp.mean(probs, axis=2))  # [B, S, E]; rows with no visible entry: 0
    keys = compress_kv(p.indexer.compressor, h, ratio=m, overlap=True, cfg=cfg)
    scores = index_scores(index_queries(p.indexer, cq, cos, sin, cfg), keys, index_weights(p.indexer, h, cfg), cfg)
    log_q = jax.nn.log_softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    kl = jnp.where(visible & (target > 0), target * (jnp.log(jnp.where(target > 0, target, 1.0)) - log_q), 0.0)
    rows = jnp.any(visible, axis=-1)
    return jnp.sum(kl) / jnp.maximum(jnp.sum(rows), 1)


def pretrain_losses(params: ModelParams, mtp: MTPParams, tokens: jax.Array, cfg: ModelConfig,
                    vocab: VocabMap | None = None, *, indexer: bool = True) -> dict[str, jax.Array]:
    """tokens [B, S + 1] (inputs tokens[:, :S], next tokens tokens[:, 1:]) -> {"lm", "mtp",
    "indexer"}: the three losses above, unweighted (indexer: mean over CSA layers). With
    `vocab`, cfg / params / tokens are the compact-vocabulary model's (dsjax/train/vocab.py)
    and lm / mtp are full-vocabulary cross-entropies."""
    inputs, nxt = tokens[:, :-1], tokens[:, 1:]
    b, s = inputs.shape
    probe = (lambda layer, p, h, pos: indexer_distillation(layer, p, h, pos, cfg)) if indexer else None
    streams, probes = decoder_streams_probed(params, inputs, cfg, probe)
    ones = jnp.ones((b, s), jnp.float32)
    lm = cross_entropy(logits_of(params, streams, cfg), nxt, ones, vocab)
    # MTP at t: main state X_t, token x_{t+1} = nxt[t]; target x_{t+2} = nxt[t + 1] (none at t = S - 1)
    out, _ = mtp_forward(mtp, params, streams, nxt, cfg)
    mtp_targets = jnp.concatenate([nxt[:, 1:], jnp.zeros((b, 1), nxt.dtype)], axis=1)
    mtp_mask = ones.at[:, -1].set(0.0)
    mtp_loss = cross_entropy(mtp_head(mtp, params, out, cfg), mtp_targets, mtp_mask, vocab)
    kls = jax.tree.leaves(probes)  # [repeats] per CSA period position
    idx = (sum(jnp.sum(k) for k in kls) / sum(k.size for k in kls)) if kls else jnp.zeros((), jnp.float32)
    return {"lm": lm, "mtp": mtp_loss, "indexer": idx}
