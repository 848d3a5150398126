"""gpuhookd: an optional, socket-activated root daemon that keeps the GPU path imported.

A Python hook pays for its imports on every container start: about 45 ms for the GPU path on
a small VM, more than the start of the container itself (``make bench``). With gpuhookd running,
the hook does only its no-GPU check, then passes what it read (the OCI state and config.json
bytes, its environment) and fds of its namespaces over ``/run/gpuhook/gpuhookd.sock``; a
child forked from the warm daemon does the work in the hook's own view of the host and
answers with the exit status. Without the daemon the hook does the same work itself.

``wire`` is the message format, ``client`` the hook's side, ``server`` the daemon.
"""
