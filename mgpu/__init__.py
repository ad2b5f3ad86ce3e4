"""mgpu: multi-process, multi-GPU data-parallel training for PyTorch. Folders by concern, their
imports running one way (docs/layout.md): run -> train -> ckpt -> optim -> comm -> models, data
-> telemetry -> config -> runtime. The modules here are the after-training commands (python -m
mgpu.evaluate, mgpu.sample, mgpu.export) and what they share (restore): they may import any
folder, and no folder imports them.
"""
