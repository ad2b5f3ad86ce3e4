"""Datasets: map-style, deterministic per (args, split, index), each built as Cls(split, ...).

Synthetic n-gram tokens, synthetic class-conditional images, and memory-mapped token files.
"""

from mgpu.data.images import SyntheticImages
from mgpu.data.ngram import NgramTokens
from mgpu.data.token_file import TokenFile

__all__ = ["NgramTokens", "SyntheticImages", "TokenFile"]
