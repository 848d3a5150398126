"""A prestart hook for tests: write the hex instructions of the container's cgroup v2 device programs to argv[1]."""

import json
import os
import sys

from gpuhook.apply.cgroups import locate_device_cgroup
from gpuhook.sys import syscalls

state = json.load(sys.stdin)
cgroup = locate_device_cgroup(state["pid"])
fd = os.open(cgroup.path, os.O_RDONLY | os.O_DIRECTORY)
programs = syscalls.bpf_query_device_programs(fd)
lines = [syscalls.bpf_program_instructions(syscalls.bpf_program_fd(i)).hex() for i in programs]
with open(sys.argv[1], "w") as out:
    out.write("\n".join(lines) + "\n")
