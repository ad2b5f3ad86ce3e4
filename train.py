"""mgpu's entry point: config -> typed objects -> process group -> build -> fit -> teardown.

torchrun --nproc_per_node=2 train.py [key=value ...]
"""

# ruff: noqa: E402 - the start time is taken before the imports, which take seconds

import time

STARTED_AT = time.time()  # goodput's start-up counts from here
JOINED = False  # whether this process joined a process group (see the teardown rule below)

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from mgpu.checkpoint import CheckpointError
from mgpu.config import ConfigError, to_config
from mgpu.dist import Runtime, check_same_config, distributed
from mgpu.guard import NonFiniteStep
from mgpu.preempt import PREEMPTED_EXIT_CODE, Preempted, Preemption
from mgpu.run import build_run
from mgpu.state import CheckpointMismatch
from mgpu.watchdog import CollectiveTimeout

log = logging.getLogger("mgpu")


def quiet_other_ranks(rt: Runtime) -> None:
    """Only rank 0 talks on the console; every rank keeps its full log file."""
    if not rt.is_primary:
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler:
                handler.setLevel(logging.WARNING)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    cfg = to_config(dcfg)  # already validated before Hydra made the run directory
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    exit_code = 0
    with distributed(cfg.dist.backend.value, cfg.dist.timeout_s, cfg.dist.cpu_affinity) as rt:
        global JOINED
        JOINED = rt.has_process_group
        resolved = OmegaConf.masked_copy(dcfg, [k for k in dcfg if k != "hydra"])
        text = OmegaConf.to_yaml(resolved, resolve=True)
        check_same_config(text, rt, run_dir)  # before any work: stops every rank if they differ
        quiet_other_ranks(rt)
        # Rank 0 says why on the console; every rank's log file has it.
        primary = rt.is_primary
        try:
            with Preemption(rt) as preemption:  # SIGTERM/SIGUSR1: save at a step boundary
                build_run(
                    cfg, rt, run_dir, text, preemption=preemption, started_at=STARTED_AT
                ).fit()
        except Preempted as err:
            (log.warning if primary else log.info)(
                "%s: checkpoint saved; exit code %d, run the same command to resume",
                err,
                PREEMPTED_EXIT_CODE,
            )
            exit_code = PREEMPTED_EXIT_CODE
        except CollectiveTimeout as err:
            log.error("%s", err)  # the rank that waited, on whichever rank it is
            exit_code = 1
        except (CheckpointError, CheckpointMismatch, ConfigError, NonFiniteStep) as err:
            # Every rank meets these at the same point: all stop, no collective is left waiting.
            (log.error if primary else log.info)("%s", err)
            exit_code = 1
    if exit_code:
        raise SystemExit(exit_code)


def exit_code_of(stop: SystemExit) -> int:
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)  # sys.exit("message") prints it and exits 1
    return 1


if __name__ == "__main__":
    try:
        main()
        code = 0
    except SystemExit as stop:  # Hydra ends with sys.exit, errors included
        code = exit_code_of(stop)
    if not JOINED:  # no process group, no communication threads: a plain exit
        sys.exit(code)
    # Teardown rule: by here the process group is destroyed and every file this run writes is
    # closed. The process ends without Python's and C++'s teardown of torch's communication
    # threads, which can abort ("terminate called without an active exception") after the
    # work is done and turn a finished run into a failed one.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
