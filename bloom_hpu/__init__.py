"""BLOOM text generation with static shapes: fast on Intel Gaudi (HPU), also on CUDA and the CPU."""
