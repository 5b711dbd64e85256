"""GGUF files: the header reader (and its cache), the architecture a header
describes, RoPE factors, tensor-parallel pieces of quantized tensors, the
tokenizer metadata and its checks, and the weight loader.
"""
