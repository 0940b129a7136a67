"""The inference engine: compressed caches, jitted prefill / decode, sampling, scheduling."""

from dsjax.engine.engine import Engine
from dsjax.engine.prefix_cache import PrefixCacheOptions
from dsjax.engine.requests import TokenEvent
from dsjax.engine.sampler import SamplingParams

__all__ = ["Engine", "PrefixCacheOptions", "SamplingParams", "TokenEvent"]
