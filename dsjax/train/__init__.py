"""Training code, kept out of the inference path: it shares the model's functions
(dsjax.model) and adds losses, optimizers and data. Nothing under dsjax/ imports it.

    pretrain.py      pretraining from scratch (AdamW, warmup + cosine, resumable checkpoints, JSONL log)
    objective.py     its loss: next-token CE + MTP CE + Lightning Indexer distillation (KL)
    data.py          the corpus: the pinned Python stdlib file list (stdlib_files.json), packing
    vocab.py         the training vocabulary: rare tokens share one row, exact full-vocab softmax
    export.py        trained weights -> a DeepSeek-format checkpoint (FP8 / MXFP4) for load_model
    mtp_distill.py   self-distillation of the MTP drafter on the target's own continuations
"""
