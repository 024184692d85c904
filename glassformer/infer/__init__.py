"""Generation jobs: the decode engine and the sampler (seed 000 §2.5, seed 002 "采样")."""
