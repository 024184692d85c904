"""One module per architecture family; importing registers their name tables."""

from glassformer.interop.archs import bart, bert, gpt2, llama, t5  # noqa: F401
