"""Model configs and run options.

    schema.py   ModelConfig / RopeConfig / V41Config: what the model is, validated once
    layer_plan.py  LayerSpec (with V4.1's Sharing) per layer, the scanned LayerRun plan
    io.py       HF config.json (current and legacy keys), JSON files, named configs
    options.py  RuntimeOptions: how to run it (kernels, MoE capacity, batch invariance)
"""

from dsjax.config.io import configs_dir, from_hf_dict, from_json, load_config, named_configs, to_hf_dict
from dsjax.config.layer_plan import HASH_MOE
from dsjax.config.options import KERNELS, RuntimeOptions
from dsjax.config.schema import (CSA, HCA, LAYER_TYPES, MLP_LAYER_TYPES, SCORING_FUNCS, SLIDING, TOPK_MOE,
                                 ConfigError, LayerRun, LayerSpec, ModelConfig, RopeConfig)

__all__ = ["CSA", "ConfigError", "HASH_MOE", "HCA", "KERNELS", "LAYER_TYPES", "LayerRun", "LayerSpec", "MLP_LAYER_TYPES",
           "ModelConfig", "RopeConfig", "RuntimeOptions", "SCORING_FUNCS", "SLIDING", "TOPK_MOE", "configs_dir",
           "from_hf_dict", "from_json", "load_config", "named_configs", "to_hf_dict"]
