"""The settings every part shares: the error a bad value raises and the checks schemas run
(checks), and the trainer, dist, optim and ckpt groups' typed schemas (schema). The data and
model groups' schemas are those folders' own (mgpu.data.config, mgpu.models.config); the whole
Config that composes every group is the run's (mgpu.run.config).

May import: runtime.
"""
