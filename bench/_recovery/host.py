"""What the host did while a round's measured stretch ran: the rank processes' CPU time split
into user and system, their minor page faults, and the memory the guest kernel handed back to
its hypervisor (free page reporting), so a step-time ratio comes with what the machine did
beside it.

[Note: a guest that hands freed memory back] The development VM is a Firecracker guest whose
virtio-balloon reports free memory to the host (`/sys/module/page_reporting/parameters`:
`page_reporting_order` 9, i.e. 2 MiB blocks, `min_free_ms` 0), in bursts that come and go
with the host, it seems; the host discards those pages, and the next allocation that lands on
one faults into the hypervisor. A rank's training thread then spends 0.1-0.28 s of system
time in one step zeroing freshly allocated pages (`perf`: `clear_page_erms` under
`get_page_from_freelist`, from a `fill_` of new gradient memory: 2.3% of the rank processes'
samples under `auto` against 0.3% with the tier off). On the 256 MiB job on 2x1 at
`ckpt_every 5`, 100-step stretches under `auto` saw 318-388 MiB reported to the host and 7-8
such steps, the tier-off stretches beside them 10-12 MiB and none (2 pairs). Where that
memory comes from was not found: the ranks' page faults, and the pages each process freed
(`perf`'s `kmem` tracepoints), were the same in both settings. An hour later, with the host
quiet (0-6 MiB a stretch), `auto` spent as much system time as the tier off and no step
spiked, while a tier-off stretch that reported 776 MiB had 1-1.8 s steps. Bare metal and VMs
without free page reporting have no such cost; the bench records both, so a report says
which machine it ran on.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PAGE_REPORTING_DIR = Path("/sys/module/page_reporting/parameters")
"""Where a Linux guest with free page reporting (virtio-balloon) shows its settings."""
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def page_reporting(directory: Path = PAGE_REPORTING_DIR) -> dict[str, int | str] | None:
    """The guest's free page reporting settings and total (`reported_kib`), or None where the
    kernel has none ([Note: a guest that hands freed memory back])."""
    if not directory.is_dir():
        return None
    out: dict[str, int | str] = {}
    for item in sorted(directory.iterdir()):
        try:
            text = item.read_text(encoding="ascii").strip()
        except OSError:
            continue
        out[item.name] = int(text) if text.lstrip("-").isdigit() else text
    return out


def _reported_kib(directory: Path) -> int | None:
    try:
        return int((directory / "reported_kib").read_text(encoding="ascii"))
    except (OSError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class _ProcessTimes:
    user_s: float
    system_s: float
    minor_faults: int


def _process_times(pid: int) -> _ProcessTimes | None:
    """All threads of `pid` together (`/proc/<pid>/stat`); None once it has exited."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return None
    # Fields after the command name, which may hold spaces: state is the first.
    fields = text[text.rindex(")") + 2 :].split()
    return _ProcessTimes(
        user_s=int(fields[11]) / _TICKS_PER_S,
        system_s=int(fields[12]) / _TICKS_PER_S,
        minor_faults=int(fields[7]),
    )


class StretchProbe:
    """The host's counters at the start of a stretch; `end()` gives what changed since."""

    def __init__(self, rank_pids: Iterable[int], directory: Path = PAGE_REPORTING_DIR) -> None:
        self._directory = directory
        self._start = {pid: _process_times(pid) for pid in rank_pids}
        self._reported_start = _reported_kib(directory)

    def end(self) -> dict[str, Any]:
        """Rank CPU seconds (user, system) and minor faults summed over the processes alive at
        both ends, the MiB reported to the host (None without free page reporting), and how
        many rank processes were followed."""
        user = system = 0.0
        faults = followed = 0
        for pid, start in self._start.items():
            now = _process_times(pid)
            if start is None or now is None:
                continue
            followed += 1
            user += now.user_s - start.user_s
            system += now.system_s - start.system_s
            faults += now.minor_faults - start.minor_faults
        reported_end = _reported_kib(self._directory)
        reported = (
            None
            if reported_end is None or self._reported_start is None
            else (reported_end - self._reported_start) / 1024
        )
        return {
            "rank_processes": followed,
            "rank_user_cpu_s": round(user, 2),
            "rank_system_cpu_s": round(system, 2),
            "rank_minor_faults": faults,
            "reported_to_host_mib": None if reported is None else round(reported, 1),
        }
