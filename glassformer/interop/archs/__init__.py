"""One module per architecture family; importing registers their name tables."""

from glassformer.interop.archs import bert, gpt2, llama  # noqa: F401
