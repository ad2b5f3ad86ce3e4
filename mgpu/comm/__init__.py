"""Gradient communication: the engine dist.engine picks (engine: mgpu's wrapper, torch DDP, or
none), mgpu's reducer, which all-reduces buckets on a communication stream during backward
(reducer), the buckets' memory layout (buckets), and dist.shard_optimizer's reduce-scattered
buckets (shard) with the optimizer stepping this rank's shards (sharded_optim).

May import: telemetry, config, runtime.
"""
