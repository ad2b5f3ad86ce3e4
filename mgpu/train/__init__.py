"""The Trainer and what it calls each step: the loop, evaluation and its state (trainer), batches
fed to the step (feed), the optimizer step with clipping and loss scaling (update), the per-step
agreement on non-finite values and preemption (guard), precision and math modes (numerics, fp8),
CUDA graphs (graphs), and hang reports (watchdog).

May import: ckpt, optim, comm, models, data, telemetry, config, runtime.
"""
