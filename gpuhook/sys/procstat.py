"""Another process's identity from /proc: its start time, which tells a reused pid from the one meant.

A pid alone is reused by the kernel once its process is reaped; the start time (field 22 of
/proc/PID/stat, clock ticks after boot) is not, so the pair names one process for the machine's
uptime. A zombie (state Z, or X while it is reaped) no longer runs: it counts as gone.
"""

from __future__ import annotations


def start_ticks(pid: int) -> int | None:
    """*pid*'s start time in clock ticks after boot; None when no such process runs (or it is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:  # ENOENT, ESRCH: gone
        return None
    # The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
    fields = stat.rpartition(b")")[2].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])
