"""Training jobs: the trainer, optimizers and atomic checkpoints."""
