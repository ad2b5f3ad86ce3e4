"""mgpu's entry point: command line -> config -> typed objects -> process group -> build -> fit ->
teardown.

torchrun --nproc_per_node=2 train.py [key=value ...]
"""

# ruff: noqa: E402 - the start time is taken before the imports, which take seconds

import gc
import signal
import time

STARTED_AT = time.time()  # goodput's start-up counts from here
# No cyclic garbage collection while the run starts: importing torch (and torch._dynamo, which
# the optimizer imports) and Hydra makes hundreds of thousands of objects that live as long as
# the process, and the collector would walk them again and again as they are made: a fifth of
# a rank's start-up CPU. main() freezes them once the run is built. Not in
# DataLoader workers, which run this file's top level again as __mp_main__ and never reach
# main(): they keep collection on for their whole life.
if __name__ == "__main__":
    gc.disable()
# Held back until the config is checked (mgpu.run.cli.release_sigterm says why)
HELD_SIGTERMS: list[int] = []
signal.signal(signal.SIGTERM, lambda signum, _frame: HELD_SIGTERMS.append(signum))

import os
import sys


def interrupted_while_starting(_signum, _frame) -> None:
    """Ctrl-C before the run is built (imports, checks, joining the other ranks): one line from
    rank 0 and exit 130, nothing trained or saved yet; mgpu.run.interrupt takes over from there."""
    if os.environ.get("RANK", "0") == "0":
        print("interrupted (Ctrl-C) while starting, before the first step", file=sys.stderr)
        sys.stderr.flush()
    os._exit(130)  # 128 + SIGINT; no traceback from the import or wait it arrived in


# Not in DataLoader workers, which run this file's top level again as __mp_main__: a worker
# would say the line above (and end) at a Ctrl-C that the training process says in its own.
if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted_while_starting)

# A user's own model or dataset (model._target_=mypkg.nets.TwoLayer) is imported from the folder
# the run starts in, as under `python -m`: a script's sys.path begins with the script's folder,
# not the working directory. Second, so that mgpu's own modules win over a same-named folder.
sys.path.insert(1, os.getcwd())

from mgpu.runtime.orphan import end_with_agent

end_with_agent()  # a torchrun worker dies with its agent; first, before the slow imports

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mgpu.run.build import build_run
from mgpu.run.cli import release_sigterm, stop_on_bad_command_line
from mgpu.run.config import resolved_yaml, to_config
from mgpu.run.interrupt import interrupted
from mgpu.runtime.dist import (
    check_same_config,
    distributed,
    exit_process,
    quiet_other_ranks,
    stopped,
)
from mgpu.runtime.launch import default_cuda_connections, launch_env
from mgpu.runtime.preempt import Preemption
from mgpu.runtime.run_lock import hold_run_dir
from mgpu.runtime.run_name import resume_advice


def freeze_start_up_objects(on_gpu: bool) -> None:
    """Collection, held back since the top of this file, on from here: what start-up made
    (modules, classes, the built run) frozen first, so that training's collections never walk
    it. Its cyclic garbage is collected first on a GPU only: there it holds device tensors (on
    a CPU run, a probe's batch and copies of BatchNorm buffers among ~5 MB of Hydra's composed
    configs), which freezing would keep for the whole run; on a CPU the collection took
    0.3-0.5 s of each rank's CPU to free those 5 MB."""
    if on_gpu:
        gc.collect()
    gc.freeze()
    gc.enable()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    cfg = to_config(dcfg)  # already validated before Hydra made the run directory
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    advice = resume_advice(run_dir, cfg.ckpt.resume)  # in the lines of the stops below
    release_sigterm(HELD_SIGTERMS, advice)  # the checks passed (Hydra's callback ran before)
    pin = cfg.pins_cpus(launch_env().local_world_size)  # dist.cpu_affinity, auto resolved
    with distributed(cfg.dist.backend.value, cfg.dist.timeout_s, pin) as rt:
        # A stop (preemption, a hang, a bad checkpoint or config, a non-finite step, a rank
        # that never came) becomes one line and the process's exit code
        # (mgpu.runtime.dist.RunStopped).
        with stopped(rt):
            quiet_other_ranks(rt)  # first: a stop below is said once, by rank 0
            text = resolved_yaml(dcfg)
            check_same_config(text, rt, run_dir)  # before any work: stops every rank if differ
            # One launch per run directory (exit 2 if another holds it); Preemption: SIGTERM
            # and SIGUSR1 save, then stop.
            run = None
            with (
                hold_run_dir(run_dir, rt, cfg.dist.timeout_s),
                Preemption(rt, advice=advice) as preemption,
            ):
                # Ctrl-C: every rank stops after a step they agree on, and one line names the
                # step reached and the newest checkpoint, exit 130
                with interrupted(
                    run_dir, lambda: run.trainer.step if run else None, advice
                ) as ctrl_c:
                    # saved with the data's paths absolute (mgpu.run.config.resolved_yaml)
                    saved = resolved_yaml(dcfg, files_from=Path.cwd())
                    run = build_run(
                        cfg, rt, run_dir, saved, preemption=preemption, ctrl_c=ctrl_c,
                        started_at=STARTED_AT,
                    )  # fmt: skip
                    freeze_start_up_objects(rt.device.type == "cuda")
                    run.fit()


if __name__ == "__main__":
    default_cuda_connections()  # before the checks below ask CUDA for its devices
    # One line and exit 2 for a command line that cannot work, before Hydra makes anything
    stop_on_bad_command_line(sys.argv[1:])
    exit_process(main)  # with mgpu.runtime.dist's teardown rule
