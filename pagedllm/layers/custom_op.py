"""Layers with several implementations pick one when they are built, not on every call.

The model is built inside build_context(platform, dtype): each CustomOp then binds its
forward_<impl> (forward_native in plain PyTorch, forward_cpu with pagedllm's C++ ops, later
forward_cuda) once, and each Attention layer takes the platform's backend. Nothing on the hot
path asks which device or dtype it runs on.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from pagedllm.platforms.interface import TORCH_ATTN_BACKEND


@dataclass(frozen=True)
class BuildContext:
    """What layers built now should run: the op implementation and the attention backend."""

    op_impl: str  # "native", "cpu", ...
    attn_backend: Any  # an AttentionBackend class


def _resolve(qualname: str) -> Any:
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def attn_backend_for(platform: Any, dtype: torch.dtype) -> Any:
    """The AttentionBackend class the platform picks for a KV cache of dtype."""
    return _resolve(platform.get_attn_backend(dtype))


_NATIVE = BuildContext("native", None)
_current: ContextVar[BuildContext] = ContextVar("pagedllm_build_context", default=_NATIVE)


@contextmanager
def build_context(platform: Any, dtype: torch.dtype) -> Iterator[BuildContext]:
    """Layers built inside use the platform's choices for this dtype."""
    ctx = BuildContext(platform.op_impl(dtype), attn_backend_for(platform, dtype))
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def current_build_context() -> BuildContext:
    """The context layers are being built in (plain PyTorch outside any build_context)."""
    ctx = _current.get()
    if ctx.attn_backend is None:
        ctx = BuildContext(ctx.op_impl, _resolve(TORCH_ATTN_BACKEND))
    return ctx


class CustomOp(nn.Module):
    """A layer whose forward is bound at construction to forward_<impl> (vLLM's CustomOp);
    an implementation a subclass lacks falls back to forward_native."""

    def __init__(self) -> None:
        super().__init__()
        impl = current_build_context().op_impl
        self.impl = impl if hasattr(self, f"forward_{impl}") else "native"
        self._forward = getattr(self, f"forward_{self.impl}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """The plain-PyTorch implementation (every platform's fallback)."""
        raise NotImplementedError
