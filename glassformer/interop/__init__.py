"""Checkpoint formats: Hugging Face folders (safetensors) and GGUF files, mapped by name tables
onto glassformer's parts. Models never import this package."""
