"""Attention backends: an implementation (the layer's kernel calls) and a metadata builder each."""
