"""DeepSeek-V4 (spec deepseek-v4.md): the decoder and its MTP drafter, on the shared layers.

    decoder.py  ModelParams and their specs, the decoder with and without a cache, `forward_rows`
    mtp.py      MTPParams, the drafter's forward and head; `MTPDrafter`
    family.py   `V4Family`: what dsjax asks of this generation (dsjax/model/family.py)
"""
