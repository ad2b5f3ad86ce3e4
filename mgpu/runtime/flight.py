"""What torch's flight recorder says about the collectives each rank issued (per process group),
and from that which ranks did not arrive at a collective others issued: the evidence a hang
report (mgpu.train.watchdog) names a rank by. Read on reports only, never in the training loop."""

from __future__ import annotations

import json
import logging

log = logging.getLogger(__name__)


def recorded_collectives() -> list[tuple[str, int, str]]:
    """(process group, sequence number, name) of each collective issued that torch's flight
    recorders (gloo's; NCCL's in CUDA builds) still hold; empty with TORCH_FR_BUFFER_SIZE=0. Read
    defensively (underscore-named API; without it reports use step and phase), on reports only."""
    from torch._C import _distributed_c10d as c10d

    found = []
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump = getattr(c10d, name, None)
        try:
            entries = json.loads(dump(True, False))["entries"] if dump is not None else []
            for e in entries:
                if not e.get("is_p2p"):
                    found.append(
                        (str(e["process_group"][0]), e["collective_seq_id"], e["profiling_name"])
                    )
        except Exception as err:  # noqa: BLE001 - a diagnostic: never the reason a report fails
            log.debug("flight recorder %s not read: %s", name, err)
    return found


def issued(found: list[tuple[str, int, str]]) -> dict[str, int]:
    """Collectives issued per process group (sequence numbers count from 1 in each group)."""
    counts: dict[str, int] = {}
    for group, seq, _ in found:
        counts[group] = max(counts.get(group, 0), seq)
    return counts


def behind(answers: dict[int, dict]) -> dict[int, tuple[str, int]]:
    """The ranks that did not arrive at a collective another rank issued: rank -> (process
    group, how many it issued there). Ranks whose recorder is off are not counted."""
    counted = {r: a["issued"] for r, a in answers.items() if a.get("issued")}
    late: dict[int, tuple[str, int]] = {}
    for group in sorted({g for c in counted.values() for g in c}):
        counts = {r: c.get(group, 0) for r, c in counted.items()}
        low = min(counts.values())
        if low == max(counts.values()):
            continue
        for rank, count in counts.items():
            if count == low:
                late.setdefault(rank, (group, low))
    return late
