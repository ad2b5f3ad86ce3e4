"""Averaged gradients into an update: AdamW/SGD, the warmup + cosine schedule, and what a resumed
run keeps of them (optimizer); fp16 loss scaling on gradient shards, its overflow agreed across
ranks (loss_scale). The sharded optimizer is gradient communication's (mgpu.comm.sharded_optim).

May import: config, runtime.
"""
