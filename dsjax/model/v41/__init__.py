"""DeepSeek-V4.1 (spec deepseek-v41.md): the backbone with cross-layer shared attention,
Engram and mHC's one-sublayer lag, and its DSpark drafter, on the shared layers.

    params.py            ModelParamsV41, DSparkParams and their specs; the FP8 the release stores
    backbone.py          the forward with and without a cache, Engram's update and host fetch
    shared_attention.py  V4.1 attention: compressed KV and top-k lists shared across layers
    dspark.py            the DSpark draft head; `DSparkDrafter`
    family.py            `V41Family`: what dsjax asks of this generation (dsjax/model/family.py)
"""
