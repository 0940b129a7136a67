"""dsjax: DeepSeek-V4 / V4.1 inference as pure JAX functions.

    import dsjax
    model = dsjax.load_model()      # the bundled trained model dsjax-tiny-py; or a checkpoint
                                    # directory, or a named config ("tiny": random weights)
    logits = model.logits([[0, 100, 200]])                  # [B, S, vocab]
    new = dsjax.generate(model, [[0, 100, 200]], max_new_tokens=8)      # ids in, ids out
    text = dsjax.generate(model, ["The capital of France is"], 8)      # text in, text out
    ll = dsjax.score(model, ["The capital of France is"], [" Paris"])  # log-likelihoods (evaluation)
    tok = dsjax.load_tokenizer()                            # encode / decode, bos_id / eos_id
    logits, trace = dsjax.inspect.forward(model, [[0, 100, 200]], capture="layers.*.moe.experts")
"""

from dsjax.api import Model, load_model, store_weights
from dsjax.chat import Chat
from dsjax.compile_cache import setup_compile_cache
from dsjax.config import ConfigError, ModelConfig, RuntimeOptions, load_config
from dsjax.engine import Engine, PrefixCacheOptions, SamplingParams, TokenEvent
from dsjax.generate import Completion, generate
from dsjax import inspect  # capture and edit intermediates: dsjax.inspect.forward (docs/inspect.md)
from dsjax.scoring import Score, score
from dsjax.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Chat", "Completion", "ConfigError", "Engine", "Model", "ModelConfig", "PrefixCacheOptions",
           "RuntimeOptions", "SamplingParams", "Score", "TokenEvent", "Tokenizer", "generate", "inspect", "load_config", "load_model",
           "load_tokenizer", "score", "setup_compile_cache", "store_weights"]
__version__ = "0.1.0"
