"""glassformer: the Transformer of the tutorials, built from scratch in readable PyTorch.

import glassformer as gf
cfg = gf.ModelConfig(family="gpt", vocab_size=65, position="rope", norm="rms", ffn="swiglu")
model = gf.build_model(cfg)
result = gf.Engine(model).generate([1, 2, 3], max_new_tokens=16, temperature=0.0)
"""

from glassformer.interrupts import interrupt_exits

with interrupt_exits():  # a Ctrl-C while torch loads: exit 130, not a traceback
    from glassformer import inspect, numpy_ref
    from glassformer.config import PRESETS, ConfigError, ModelConfig
    from glassformer.infer.compiled import CompiledDecoder
    from glassformer.infer.engine import Engine, GenerationResult, GenerationStats
    from glassformer.infer.optimize import optimize_for_decode
    from glassformer.infer.sampling import SamplingParams
    from glassformer.infer.speculative import SpeculativeDecoder, speculative_generate
    from glassformer.interop.checkpoint import CheckpointError, load
    from glassformer.interop.hf import InteropError
    from glassformer.interop.pretrained import from_pretrained
    from glassformer.models import build_model
    from glassformer.nn.quant import quantize_int8
    from glassformer.tokenizers import BPETokenizer, CharTokenizer, Tokenizer, load_tokenizer

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "BPETokenizer",
    "CharTokenizer",
    "CheckpointError",
    "CompiledDecoder",
    "ConfigError",
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "InteropError",
    "ModelConfig",
    "SamplingParams",
    "SpeculativeDecoder",
    "Tokenizer",
    "build_model",
    "from_pretrained",
    "inspect",
    "load",
    "load_tokenizer",
    "numpy_ref",
    "optimize_for_decode",
    "quantize_int8",
    "speculative_generate",
]
