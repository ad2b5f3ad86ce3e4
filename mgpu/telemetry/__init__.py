"""What a run reports, without waiting on the GPU at the step it records: the step's timing marks
and data wait (timing), host reads a step or an interval late (lagged), the Recorder's log
intervals, throughput, memory and rank spread (metrics), MFU's inputs (mfu), TensorBoard (board),
where the wall time went across restarts (goodput), the profiler window and phase ranges
(profiling).

May import: config, runtime.
"""
