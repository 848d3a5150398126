"""cgroup v2 device access: extend the runtime's eBPF program and swap it in atomically.

On cgroup v2 there is no ``devices.allow``; the runtime attaches a
``BPF_CGROUP_DEVICE`` program and every attached program must allow an access,
so adding a second program cannot widen access (runtime-lab.md §1). We read
each attached program back (``BPF_PROG_QUERY``, ``BPF_OBJ_GET_INFO_BY_FD``),
put the exact GPU rules in front of its unchanged instructions
(``bpfinsn.allow_block``), load that, and replace the original with
``BPF_F_REPLACE`` — one atomic step, no window without a program.
libnvidia-container instead detached and re-attached, and its "generate from
existing programs" broke on kernel 6.12 (``last insn is not an exit or jmp``).
A program whose shape we do not recognise is refused, never weakened.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpuhook.apply.bpfinsn import allow_block, decode, encode, extendable
from gpuhook.errors import ApplyError
from gpuhook.planning.plan import CgroupRule
from gpuhook.sys import syscalls

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpuhook.apply.cgroups import Undo  # cgroups imports this module when it meets v2: no circle at run time

STEP = "device cgroup (eBPF)"


def grant(path: Path, rules: tuple[CgroupRule, ...]) -> Undo:
    """Allow *rules* for the cgroup at *path*; returns the undo that restores the runtime's programs."""
    devices = [(r.major, r.minor, r.access) for r in rules]
    try:
        cgroup_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        program_ids = syscalls.bpf_query_device_programs(cgroup_fd)
    except OSError as err:
        raise ApplyError(STEP, str(path), errno_=err.errno) from err
    swapped: list[tuple[int, int]] = []

    def undo() -> None:
        for old_fd, new_fd in reversed(swapped):
            syscalls.bpf_replace_device_program(cgroup_fd, old_fd, new_fd)

    try:
        for program_id in program_ids:
            old_fd = syscalls.bpf_program_fd(program_id)
            program = decode(syscalls.bpf_program_instructions(old_fd))
            why = extendable(program)
            if why is not None:
                raise ApplyError(STEP, str(path), detail=(
                    f"the runtime's device program {program_id} cannot be extended safely: {why}. Refusing rather "
                    "than weakening isolation; use `gpuhook spec-edit` so the runtime allows the GPU devices itself"
                ))
            new_fd = syscalls.bpf_load_device_program(encode((*allow_block(devices), *program)))
            syscalls.bpf_replace_device_program(cgroup_fd, new_fd, old_fd)
            swapped.append((old_fd, new_fd))
    except OSError as err:
        undo()
        raise ApplyError(STEP, str(path), errno_=err.errno, detail=err.strerror or "") from err
    except ApplyError:
        undo()
        raise
    return undo
