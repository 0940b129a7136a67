"""Training code, kept out of the inference path: it shares the model's functions
(dsjax.model) and adds losses, optimizers and data. Nothing under dsjax/ imports it.

    mtp_distill.py   self-distillation of the MTP drafter on the target's own continuations
"""
