"""The launch environment and the process group, at the bottom of mgpu: what torchrun or SLURM
handed this process (launch), device pinning, joining the process group with bounded waits, the
start-up collectives (dist), exit codes and teardown (ending), the one-line stops (stops),
Ctrl-C acted on where the run can stop (ctrl_c), side channels through the launch's store: hang
reports' client and which ranks are gone (peers), the collectives each rank issued by torch's
flight recorder (flight), SIGTERM/SIGUSR1 preemption (preempt), one launch per run directory
(run_lock), and workers that end with their agent (orphan).

May import: nothing outside it.
"""
