"""Tokenizers and chat templates: the fast tokenizer (byte-level BPE and
SentencePiece) built from a GGUF's vocabulary or a tokenizer.json, its on-disk
cache, the transformers wrapper, the chat-template renderer, the templates known
by name, and the chat messages the engine and the server hand it.
"""
