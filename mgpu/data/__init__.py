"""Datasets: map-style, deterministic per (args, split, index), each built as Cls(split, ...).

Synthetic n-gram tokens, synthetic class-conditional images, memory-mapped token files, and
images from a class-per-subfolder tree, or from the tar shards prepare_images makes of one.
"""

from mgpu.data.image_folder import ImageFolder
from mgpu.data.image_shards import ImageShards
from mgpu.data.images import SyntheticImages
from mgpu.data.ngram import NgramTokens
from mgpu.data.token_file import TokenFile

__all__ = ["ImageFolder", "ImageShards", "NgramTokens", "SyntheticImages", "TokenFile"]
