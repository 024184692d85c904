"""glassformer: the Transformer of the tutorials, built from scratch in readable PyTorch.

import glassformer as gf
cfg = gf.ModelConfig(family="gpt", vocab_size=65, position="rope", norm="rms", ffn="swiglu")
model = gf.build_model(cfg)
result = gf.Engine(model).generate([1, 2, 3], max_new_tokens=16, temperature=0.0)
"""

from glassformer.config import PRESETS, ConfigError, ModelConfig
from glassformer.infer.engine import Engine, GenerationResult, GenerationStats
from glassformer.infer.sampling import SamplingParams
from glassformer.interop.hf import InteropError
from glassformer.interop.pretrained import from_pretrained
from glassformer.models import build_model
from glassformer.tokenizers import BPETokenizer, CharTokenizer, Tokenizer, load_tokenizer
from glassformer.train.checkpoint import CheckpointError, load

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "BPETokenizer",
    "CharTokenizer",
    "CheckpointError",
    "ConfigError",
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "InteropError",
    "ModelConfig",
    "SamplingParams",
    "Tokenizer",
    "build_model",
    "from_pretrained",
    "load",
    "load_tokenizer",
]
