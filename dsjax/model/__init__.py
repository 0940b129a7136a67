"""The model: each generation a sibling package on the shared layers (dsjax/layers), the
generation chosen once from the config (`family_of`), one forward, the cache.

    interface.py     the engine's one door into the model: forward, cache, head, `Drafter`
    family.py        `ModelFamily` and `family_of(cfg)`: what differs between generations
    v4/              DeepSeek-V4: decoder.py (ModelParams, the decoder), mtp.py (the MTP drafter)
    v41/             DeepSeek-V4.1: params.py, backbone.py (the lagged blocks, Engram),
                     shared_attention.py (cross-layer shared KV), dspark.py (the DSpark drafter)
    block.py         the decoder block both stack (`block_apply`, V4.1's lag a parameter)
    head.py          the vocabulary head: its weight, CPU forms, the logits of a step's rows
    forward_pass.py  `forward(params, tokens, cfg, cache=None, ...)`, batch-invariant tiles
    cache.py         Cache pytree, batch-major row helpers, the rows a chunk writes (rollback)
    cache_layout.py  a config's cache: shapes, init, bytes, smallest ring, prefix-block layout
    stored.py        weight spec trees as stored / as resident mode keeps them

This package's namespace gathers the names notebooks and tests use most: V4's parameters,
decoder and MTP drafter, the forward and the cache.
"""

from dsjax.model.block import Block, layer_block, layer_slot
from dsjax.model.cache import Cache, batch_axes, put_rows, take_rows
from dsjax.model.cache_layout import cache_bytes, cache_shapes, init_cache
from dsjax.model.family import family_of
from dsjax.model.forward_pass import forward
from dsjax.model.head import head_logits
from dsjax.model.v4.decoder import ModelParams, decoder_streams, decoder_streams_probed, logits_of, model_specs
from dsjax.model.v4.mtp import MTPParams, mtp_forward, mtp_head, mtp_specs

__all__ = ["Block", "Cache", "MTPParams", "ModelParams", "batch_axes", "cache_bytes", "cache_shapes", "decoder_streams",
           "decoder_streams_probed", "family_of", "forward", "head_logits", "init_cache", "layer_block", "layer_slot",
           "logits_of", "model_specs", "mtp_forward", "mtp_head", "mtp_specs", "put_rows", "take_rows"]
