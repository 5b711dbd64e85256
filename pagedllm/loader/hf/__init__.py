"""Hugging Face checkpoints: config.json -> architecture (decoders and encoders),
safetensors headers and weights, and the sentence-transformers pooling files.
"""
