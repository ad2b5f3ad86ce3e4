"""Checkpoints: their layout, manifest checks and safe loading (checkpoint), crash-safe writing
and pruning (write), what they hold and how it goes back into live objects (state), and the
policy: which checkpoint a launch resumes from, when to save, every rank saving together (resume).

May import: optim, data, config, runtime.
"""
