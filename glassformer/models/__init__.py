"""Model families built from the one parts library: GPT and BERT; seq2seq and RNN build on it."""

from __future__ import annotations

from torch import nn

from glassformer.config import ConfigError, ModelConfig
from glassformer.models.bert import BERT
from glassformer.models.common import LossOutput
from glassformer.models.gpt import GPT
from glassformer.models.rnn import RNNLM
from glassformer.models.seq2seq import Seq2Seq

FAMILY_CLASSES: dict[str, type[nn.Module]] = {
    "gpt": GPT,
    "bert": BERT,
    "rnn": RNNLM,
    "seq2seq": Seq2Seq,
}


def build_model(cfg: ModelConfig) -> nn.Module:
    """A randomly initialized model of the config's family."""
    if cfg.family not in FAMILY_CLASSES:
        raise ConfigError(
            f"family={cfg.family!r} cannot be built yet: buildable families are "
            f"{', '.join(FAMILY_CLASSES)}"
        )
    return FAMILY_CLASSES[cfg.family](cfg)


__all__ = ["BERT", "FAMILY_CLASSES", "GPT", "RNNLM", "LossOutput", "Seq2Seq", "build_model"]
