"""Attention over the paged KV cache: a reference implementation and faster backends."""

from kernels.attention.metadata import AttentionMetadata
from kernels.attention.params import AttentionParams
from kernels.attention.selector import AttentionBackend, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionParams", "get_attention_backend"]
