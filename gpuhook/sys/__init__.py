"""Thin bindings to the Linux calls Python 3.11 lacks: no gpuhook types, no policy.

Import the modules by name (``from gpuhook.sys import pathrs``), never the package as
``sys``, which would shadow the standard library's. The package itself imports
nothing, so that loading :mod:`gpuhook.sys.fdpass` on the hook's path loads no ctypes.

* ``pathrs``    read-only: openat2 ``RESOLVE_IN_ROOT`` and its walker fallback, fd paths, namespace identity
* ``mountinfo`` read-only: the one ``/proc/<pid>/mountinfo`` parser, mount ids
* ``files``     writes: atomic file replacement
* ``fdpass``    bytes only: SCM_RIGHTS payloads and SO_PEERCRED credentials
* ``process``   the calling process's own attributes: prctl, close_range
* ``syscalls``  the mutating half: mount API, setns/unshare, the bounding set, bpf(2)
"""
