"""A prestart "hook" that forges gpuhook's input, then becomes gpuhook (security.md §4 D33-D38).

Run by runc as ``python -I forge.py [OPTIONS] -- HOOK ARGV...``. It reads the real OCI state runc
writes on stdin, changes it as the options say, and execs HOOK ARGV with the forged state on its
stdin (same pid, so gpuhook's "own pid" is this process's pid):

``--set KEY=JSON``    set a state field to a JSON value; ``@self`` is this pid, ``@dead`` the pid of
                      a process that has exited, ``@nan`` the bare token NaN;
``--del KEY``         remove a state field;
``--raw TEXT``        replace the whole state with TEXT;
``--stdin MODE``      ``hang``: a writer that never writes nor closes; ``huge``: an endless stream
                      (the writer dies with gpuhook: PR_SET_PDEATHSIG);
``--cwd MODE``        start gpuhook with cwd ``rootfs`` (the bundle's rootfs), ``deleted`` (a
                      removed directory) or ``fd:PATH`` (PATH opened and kept open, via /proc/self/fd).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

_PR_SET_PDEATHSIG = 1
_NAN = "\0nan\0"


def _value(text: str) -> object:
    """A --set value."""
    if text == "@self":
        return os.getpid()
    if text == "@dead":
        child = subprocess.Popen(["/bin/true"])
        child.wait()
        return child.pid
    if text == "@nan":
        return _NAN
    return json.loads(text)


def _writer(read_fd: int, write_fd: int, mode: str) -> None:
    """Fork the process that holds the pipe's write end: silent forever, or an endless stream."""
    if os.fork() != 0:
        return
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.close(read_fd)
    deadline = time.monotonic() + 60  # bounded even if PDEATHSIG were lost
    try:
        if mode == "huge":
            chunk = b'{"pad": "' + b"x" * 65536
            os.write(write_fd, chunk)
            while time.monotonic() < deadline:
                os.write(write_fd, b"x" * 65536)
        else:
            time.sleep(60)
    except OSError:
        pass
    os._exit(0)


def main(argv: list[str]) -> int:
    """Forge and exec."""
    split = argv.index("--")
    options, hook = argv[:split], argv[split + 1:]
    state = json.loads(sys.stdin.buffer.read())
    raw: bytes | None = None
    stdin_mode = cwd_mode = ""
    it = iter(options)
    for opt in it:
        arg = next(it)
        if opt == "--set":
            key, _, text = arg.partition("=")
            state[key] = _value(text)
        elif opt == "--del":
            state.pop(arg, None)
        elif opt == "--raw":
            raw = arg.encode("utf-8", "surrogateescape")
        elif opt == "--stdin":
            stdin_mode = arg
        elif opt == "--cwd":
            cwd_mode = arg
        else:
            raise SystemExit(f"forge.py: unknown option {opt}")
    data = raw if raw is not None else json.dumps(state).replace(json.dumps(_NAN), "NaN").encode()

    read_fd, write_fd = os.pipe()
    if stdin_mode in ("hang", "huge"):
        _writer(read_fd, write_fd, stdin_mode)
    else:
        os.write(write_fd, data)  # small: fits in the pipe buffer
    os.close(write_fd)
    os.dup2(read_fd, 0)
    os.close(read_fd)

    if cwd_mode == "rootfs":
        os.chdir(os.path.join(state["bundle"], "rootfs"))
    elif cwd_mode == "deleted":
        gone = tempfile.mkdtemp(prefix="gpuhook-attack-cwd-")
        os.chdir(gone)
        os.rmdir(gone)
    elif cwd_mode.startswith("fd:"):
        fd = os.open(cwd_mode[3:], os.O_RDONLY | os.O_DIRECTORY)  # inheritable: leaks into gpuhook
        os.set_inheritable(fd, True)
        os.chdir(f"/proc/self/fd/{fd}")
    os.execv(hook[0], hook)
    return 127


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
