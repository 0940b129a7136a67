"""dsjax: DeepSeek-V4 / V4.1 inference as pure JAX functions.

    import dsjax
    model = dsjax.load_model("tiny", dtype="float32")       # or a checkpoint directory
    logits = model.logits([[0, 100, 200]])                  # [B, S, vocab]
    new = dsjax.generate(model, [[0, 100, 200]], max_new_tokens=8)
"""

from dsjax.api import Model, load_model
from dsjax.config import ConfigError, ModelConfig, RuntimeOptions, load_config
from dsjax.engine import Engine, SamplingParams, TokenEvent
from dsjax.generate import generate

__all__ = ["ConfigError", "Engine", "Model", "ModelConfig", "RuntimeOptions", "SamplingParams", "TokenEvent",
           "generate", "load_config", "load_model"]
__version__ = "0.1.0"
