"""torchrun as the launch scripts run it, ending in one line: a launch whose worker failed ends with
that worker's own line (the one mgpu recorded for torchrun) and the worker's exit code.

Usage: python launch/torchrun.py [torchrun's flags] train.py [overrides ...]

Plain torchrun ends a failed worker with its own report, some 40 lines after the line that
matters: a log line per worker it stops, a traceback of its own (ChildFailedError), a table of
the failed ranks, and exit code 1 whatever the worker's. This runs torchrun's own code with the
same flags, and instead:
- sets OMP_NUM_THREADS=1 where torchrun would (several processes per node, the variable unset),
  so that torchrun does not print its banner saying that it did;
- leaves out torchrun's two log lines for a failed worker (the stopped workers, the exit code);
- ends with the root cause's line and the worker's exit code (128 + N for signal N), the line
  left out where a worker's output on this console has shown it already, or with a
  line naming the fix for a rendezvous port that another process holds (EADDRINUSE, bare from
  the static rendezvous or wrapped in the c10d one's RendezvousConnectionError), for a
  rendezvous that timed out waiting for its nodes (RendezvousTimeoutError), or for a node
  that lost the c10d rendezvous's store mid-run, its host node lost or its launch ended
  (RendezvousConnectionError from a broken connection, raised while the agent ran), or for a
  node that never reached that store (nothing answered at the endpoint within the c10d
  rendezvous's read_timeout: the host node not started yet, a wrong address, a closed port);
- leaves out what the agent says while that store does not answer, which the last line sums
  up: the c10d rendezvous's warnings of a failed heartbeat and of a failed close, and torch's
  C++ warnings and errors with their stack traces (TCPStore: broken pipe, connection reset, a
  connection timed out), by logging only C++'s fatal errors in this process alone
  (TORCH_CPP_LOG_LEVEL=FATAL, unless set; the workers keep it unset): the Python error each of
  those ends in carries its words;
- says, before a launch of several nodes waits for the others, for how many, where and how long
  (the nodes' join_timeout, and the read_timeout within which the endpoint must answer).
A worker of mgpu records its line where torchrun reads it (TORCHELASTIC_ERROR_FILE), so that it
is said once: a config error, which no worker says itself seeing MGPU_LAUNCHER_SAYS_ERRORS=1,
here; a stop later in the run, which a worker's log says on the console and its record marks as
said (mgpu.runtime.stops.record_for_torchrun), there, unless torchrun keeps that worker's output
off this console (--local-ranks-filter, --redirects).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
import signal
import socket
import sys
import traceback

# torch reads its C++ log level once, as it loads: the agent's own is FATAL, its store client's
# warnings and errors (a heartbeat's broken pipe, a connection timed out, each with a stack
# trace) left out, the exception each ends in said instead; workers inherit none.
CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"
_CPP_LOG_LEVEL_SET = CPP_LOG_LEVEL not in os.environ
if _CPP_LOG_LEVEL_SET:
    os.environ[CPP_LOG_LEVEL] = "FATAL"

from torch.distributed import DistNetworkError  # noqa: E402
from torch.distributed.elastic.agent.server.api import ElasticAgent  # noqa: E402
from torch.distributed.elastic.multiprocessing.api import SignalException, Std  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import (  # noqa: E402
    ChildFailedError,
    ProcessFailure,
    record,
)
from torch.distributed.elastic.rendezvous.api import (  # noqa: E402
    RendezvousConnectionError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint  # noqa: E402
from torch.distributed.run import (  # noqa: E402
    determine_local_world_size,
    parse_args,
    parse_min_max_nnodes,
    run,
)

if _CPP_LOG_LEVEL_SET:
    del os.environ[CPP_LOG_LEVEL]

SAYS_ERRORS = "MGPU_LAUNCHER_SAYS_ERRORS"  # read by mgpu.run.cli.stop_with_config_error
SAID = "mgpu_said"  # in an error file: its worker has said the line (mgpu.runtime.stops)
# torchrun's log lines for a failed worker, which the last line says in full
QUIET = ("Sending process %s closing signal %s", "failed (exitcode: %s) local_rank: %s")
JOIN_TIMEOUT_S = "600"  # torch's dynamic rendezvous: join_timeout unless --rdzv-conf gives one
# the c10d rendezvous: how long a node's agent tries to reach the store at the endpoint (its
# read_timeout unless --rdzv-conf gives one)
READ_TIMEOUT_S = "60"
# the c10d rendezvous's warnings while its store does not answer (each heartbeat, the close at
# the end), which the last line sums up where the agent ends on it (rdzv_store_unreachable)
UNANSWERED = ("has failed to send a keep-alive heartbeat", "has failed to shutdown the rendezvous")


def _not_quiet(record_: logging.LogRecord) -> bool:
    return not str(record_.msg).startswith(QUIET)


def _not_unanswered(record_: logging.LogRecord) -> bool:
    said = str(record_.msg)
    return not (any(s in said for s in UNANSWERED) and "RendezvousConnectionError" in said)


def on_console(args: argparse.Namespace, local_rank: int) -> bool:
    """Whether torchrun shows this local rank's output on this console: not left out by
    --local-ranks-filter, neither of its streams sent to a file by --redirects without --tee."""
    if args.local_ranks_filter:
        try:
            shown = {int(r) for r in args.local_ranks_filter.split(",")}
        except ValueError:
            return False
        if local_rank not in shown:
            return False

    def of_rank(std: Std | dict[int, Std]) -> int:
        return int(std.get(local_rank, Std.NONE) if isinstance(std, dict) else std)

    return of_rank(Std.from_str(args.redirects)) & ~of_rank(Std.from_str(args.tee)) == 0


def said_by_a_worker(line: str, failure: ProcessFailure, args: argparse.Namespace) -> bool:
    """Whether a worker of this attempt on this node has said `line` on this console itself: its
    error file marks the line as said, and torchrun shows its output here. Every worker's file
    counts, not only those of the failures torchrun reports (the workers that had exited when it
    looked, before it stopped the others): rank 0, which says a stop that every rank meets, may
    be the last to exit. torchrun keeps them as <attempt dir>/<local rank>/error.json."""
    attempt = os.path.dirname(os.path.dirname(failure.error_file))
    for path in glob.glob(os.path.join(attempt, "*", "error.json")):
        local_rank = os.path.basename(os.path.dirname(path))
        try:
            with open(path) as f:
                message = json.load(f)["message"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a record of mgpu's: nothing said
        if not (isinstance(message, dict) and message.get(SAID) is True and local_rank.isdigit()):
            continue
        if first_line(message.get("message")) == line and on_console(args, int(local_rank)):
            return True
    return False


def first_line(text: object) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


def failure_line(rank: int, failure: ProcessFailure, args: argparse.Namespace) -> str | None:
    """The line a worker recorded for torchrun (mgpu's own, or a @record'ed exception's first
    line), else what torchrun knows: the exit code or the signal. None where a worker has said
    the recorded line on this console already: the launch ends with it there, said once."""
    said = failure.message
    if isinstance(said, dict) and said.get("message"):
        line = first_line(said["message"])
        return None if said_by_a_worker(line, failure, args) else line
    where = f"rank {rank} (local rank {failure.local_rank} on {socket.gethostname()})"
    if failure.exitcode < 0:
        return f"launch: {where} was killed by {failure.signal_name()}"
    logs = rank_logs(args, failure)
    if on_console(args, failure.local_rank) or logs is None:
        return f"launch: {where} exited with code {failure.exitcode}; its output above says why"
    return f"launch: {where} exited with code {failure.exitcode}; its output, in {logs}, says why"


def rank_logs(args: argparse.Namespace, failure: ProcessFailure) -> str | None:
    """The folder of torchrun's files for a failed rank's output (--redirects, --tee):
    <log dir>/<run>_<random>/attempt_N/<local rank>/, where its error file is (a worker that
    wrote one); else the one such folder of the log dir, or the log dir where several nodes or
    attempts share it."""
    if os.path.isdir(os.path.dirname(failure.error_file or "")):
        return os.path.dirname(failure.error_file)
    if not args.log_dir:
        return None
    found = glob.glob(os.path.join(args.log_dir, "*", "attempt_*", str(failure.local_rank)))
    return found[0] if len(found) == 1 else f"{args.log_dir} (<run>/attempt_N/{failure.local_rank})"


def exit_code(failure: ProcessFailure) -> int:
    return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode


def port_in_use(err: DistNetworkError) -> str | None:
    """One line naming the fix, for torchrun's own store failing to listen on a port that is
    in use (a static rendezvous: --master-port, or plain torchrun's 29500 before torch 2.13)."""
    if "EADDRINUSE" not in str(err):
        return None
    port = re.search(r"port: (\d+)", str(err))
    which = f"port {port[1]}" if port else "the rendezvous port"
    return (
        f"launch: {which} is in use on this machine (another launch, or another program, "
        "listens there): give this launch a free port (--master-port=PORT), or let torchrun "
        "pick one (--standalone, or launch/single_node.sh)"
    )


def rdzv_port_in_use(err: RendezvousConnectionError, endpoint: str) -> str | None:
    """One line naming the fix, for the c10d rendezvous's store failing to listen on the
    endpoint's port: torch wraps that DistNetworkError (EADDRINUSE) in its own error."""
    cause = err.__cause__
    if not (isinstance(cause, DistNetworkError) and "EADDRINUSE" in str(cause)):
        return None
    return (
        f"launch: the port of the rendezvous endpoint {endpoint} is in use on this machine "
        "(another launch, or another program, listens there): choose another port, the same "
        "on every node (RDZV_ENDPOINT=HOST:PORT; under SLURM, RDZV_PORT=PORT)"
    )


def rdzv_store_unreachable(err: RendezvousConnectionError, args: argparse.Namespace) -> str | None:
    """One line for a node whose agent cannot reach the c10d rendezvous's store
    (DistNetworkError: broken pipe, connection reset, a connection timed out); not for a port
    in use (rdzv_port_in_use). Raised while the agent ran: the node that hosts the store
    (RDZV_ENDPOINT's) was lost or its launch ended, and the agent has stopped this node's
    workers. Raised as the rendezvous started: nothing answered at the endpoint within
    read_timeout (the host node not started yet, a wrong address, a closed port)."""
    cause = err.__cause__
    if not isinstance(cause, DistNetworkError) or "EADDRINUSE" in str(cause):
        return None
    endpoint = args.rdzv_endpoint
    agent_ran = any(
        isinstance(frame.f_locals.get("self"), ElasticAgent)
        for frame, _ in traceback.walk_tb(err.__traceback__)
    )
    if agent_ran:
        return (
            f"launch: the node that hosts the rendezvous at {endpoint} is gone or unreachable "
            "(lost, or its launch ended): the run cannot go on without it, and this node's "
            "workers were stopped; run the same command on every node again to resume from the "
            "newest checkpoint"
        )
    timeout = rdzv_conf(args).get("read_timeout", READ_TIMEOUT_S)
    return (
        f"launch: nothing answered at the rendezvous endpoint {endpoint} within {timeout} s "
        "(read_timeout): start the launch on the node at that address first, and the others "
        "within that time (or give them longer: --rdzv-conf=read_timeout=SECONDS); check that "
        "RDZV_ENDPOINT is that node's address, the same on every node, and that its port is "
        "open between the nodes"
    )


def rdzv_conf(args: argparse.Namespace) -> dict[str, str]:
    """--rdzv-conf as torchrun reads it: key=value pairs, comma-separated, the last one kept."""
    pairs = (kv.split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)
    return {key.strip(): value.strip() for key, value in pairs}


def waits_for_nodes(args: argparse.Namespace) -> tuple[int, int, str, str] | None:
    """(the fewest and the most nodes, the endpoint, the join timeout in seconds) for a launch
    whose rendezvous gathers several nodes, else None (one node, or the static rendezvous)."""
    if args.standalone or args.rdzv_backend == "static":
        return None
    try:
        low, high = parse_min_max_nnodes(args.nnodes)
    except (RuntimeError, ValueError):
        return None  # torchrun itself refuses it below
    if high <= 1:
        return None
    return low, high, args.rdzv_endpoint, rdzv_conf(args).get("join_timeout", JOIN_TIMEOUT_S)


def unresolved_host(args: argparse.Namespace) -> str | None:
    """One line for a c10d rendezvous endpoint whose host name does not resolve: known at once,
    where the agent would wait out read_timeout and call it a timeout (advice for a node not yet
    started, not for a wrong name)."""
    conf = rdzv_conf(args)
    if args.standalone or args.rdzv_backend != "c10d" or conf.get("store_type") == "file":
        return None
    try:  # torch's own reading of HOST[:PORT] ([::1]:29400 too)
        host, _ = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
    except ValueError:
        return None  # torch says what is wrong with it
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as err:  # UnicodeError: a label over 63 characters
        return (
            f"launch: the rendezvous endpoint {args.rdzv_endpoint}: its host {host!r} does not "
            f"resolve ({getattr(err, 'strerror', None) or err}); give RDZV_ENDPOINT=HOST:PORT "
            "of the node that hosts the rendezvous (under SLURM, its first node's)"
        )
    return None


def main(argv: list[str]) -> int:
    args = parse_args(argv)  # torchrun's own parser: its flags, its usage errors
    unresolved = unresolved_host(args)
    if unresolved is not None:  # input that cannot work: exit 2, as a config error's
        print(unresolved, file=sys.stderr)
        return 2
    try:
        several = determine_local_world_size(args.nproc_per_node) > 1
    except ValueError:
        several = False  # "gpu" without CUDA: torchrun itself says so below
    if several and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # torchrun's own default, without its banner
    os.environ[SAYS_ERRORS] = "1"
    waits = waits_for_nodes(args)
    if waits is not None:  # else a node that never arrives is silence until the timeout
        low, high, endpoint, timeout = waits
        nodes = f"{low} nodes" if low == high else f"{low} to {high} nodes"
        said = f"launch: waiting for {nodes} at {endpoint} (for up to {timeout} s: join_timeout)"
        if args.rdzv_backend == "c10d":  # its store, hosted by the endpoint's node
            reach = rdzv_conf(args).get("read_timeout", READ_TIMEOUT_S)
            said += f"; the endpoint must answer within {reach} s (read_timeout)"
        print(said, file=sys.stderr, flush=True)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_not_quiet)
    rendezvous = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
    logging.getLogger(rendezvous).addFilter(_not_unanswered)
    try:
        # Where a scheduler gave this process an error file, torchrun's entry point copies the
        # root cause there (record); without one, record only logs that it could not.
        (record(run) if os.environ.get("TORCHELASTIC_ERROR_FILE") else run)(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        line = failure_line(rank, failure, args)
        if line is not None:
            print(line, file=sys.stderr)
        return exit_code(failure)
    except SignalException as err:  # the launch was stopped (Ctrl-C, a scheduler's SIGTERM)
        return 128 + signal.Signals(err.sigval).value
    except DistNetworkError as err:
        line = port_in_use(err)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 1
    except RendezvousConnectionError as err:
        line = rdzv_port_in_use(err, args.rdzv_endpoint) or rdzv_store_unreachable(err, args)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 1
    except RendezvousTimeoutError:
        if waits is None:
            raise
        low, _, endpoint, timeout = waits
        print(
            f"launch: fewer than {low} nodes joined the rendezvous at {endpoint} within "
            f"{timeout} s (its join timeout): start the launch on every node with the same "
            "NNODES, RDZV_ENDPOINT and RUN_ID, or give them longer "
            "(--rdzv-conf=join_timeout=SECONDS)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
