"""The model: parameter declarations, the one forward (with or without a cache), the
cache, and the MTP drafter.

    interface.py     the engine's one door into the model: forward, cache, head, `Drafter`
    decoder.py       ModelParams / Block specs, the V4 decoder
    forward_pass.py  `forward(params, tokens, cfg, cache=None, ...)`: V4's decoder or V4.1's backbone
    v41.py / dspark.py  DeepSeek-V4.1's parameters and backbone; its DSpark drafter
    cache.py    Cache pytree, shapes / bytes, the rows a chunk writes (speculative rollback)
    mtp.py      MTPParams, the drafter's forward and head; `MTPDrafter`
    stored.py   each generation's stored weight format; spec trees as resident mode keeps them
"""

from dsjax.model.cache import Cache, batch_axes, cache_bytes, cache_shapes, init_cache, put_rows, take_rows
from dsjax.model.decoder import (Block, ModelParams, decoder_streams, decoder_streams_probed, head_logits, layer_block,
                                 layer_slot, logits_of, model_specs)
from dsjax.model.forward_pass import forward
from dsjax.model.mtp import MTPParams, mtp_forward, mtp_head, mtp_specs

__all__ = ["Block", "Cache", "MTPParams", "ModelParams", "batch_axes", "cache_bytes", "cache_shapes", "decoder_streams", "decoder_streams_probed",
           "forward", "head_logits", "init_cache", "layer_block", "layer_slot", "logits_of", "model_specs",
           "mtp_forward", "mtp_head", "mtp_specs", "put_rows", "take_rows"]
