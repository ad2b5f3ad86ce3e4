"""One run from its settings: the whole Config composed from every group's schema, with the
checks across groups (config), train.py's check of its command line before Hydra starts (cli),
the run assembled in the order train.py and the benchmarks share (build), and Ctrl-C said in one
line (interrupt).

May import: train, ckpt, optim, comm, models, data, telemetry, config, runtime.
"""
