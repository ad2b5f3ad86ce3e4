"""A batch from disk to the device. Datasets, map-style and deterministic per (args, split,
index), each built as Cls(split, ...) from conf/data's `_target_`: synthetic n-gram tokens
(ngram), synthetic class-conditional images (images), memory-mapped token files (token_file), and
images from a class-per-subfolder tree (image_folder, decoded on the GPU by gpu_decode and
gpu_resize from the samples its workers hand over: encoded) or from the tar shards
prepare_images makes of one (image_shards); tokenizers and the prepare command. The data group's
schemas (config), each rank's shard of the samples (sampler), the pinned DataLoader (loader),
the side-stream prefetcher (prefetch), nested batches (batches).

May import: telemetry, config, runtime.
"""

from mgpu.data.image_folder import ImageFolder
from mgpu.data.image_shards import ImageShards
from mgpu.data.images import SyntheticImages
from mgpu.data.ngram import NgramTokens
from mgpu.data.token_file import TokenFile

__all__ = ["ImageFolder", "ImageShards", "NgramTokens", "SyntheticImages", "TokenFile"]
