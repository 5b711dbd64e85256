"""Checkpoints into weights: the GGUF reader (gguf/) and the Hugging Face one (hf/), and what
both share here: the checkpoint front (checkpoint.py: resolve a path, read its arch, load its
weights), errors, arch values, metadata, fused and stacked rows, Gemma's and windowed layers'
arch, load progress and weight checks."""
