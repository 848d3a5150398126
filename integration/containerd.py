"""A private containerd for tests, and images made from a rootfs directory (runtime-lab.md §5).

Facts this module is built on (containerd/ctr 1.6.20 on these hosts):

* ``containerd --config X`` with ``version = 2`` and the CRI plugin disabled is ready in about
  40 ms; with private ``root``, ``state`` and grpc address it shares nothing with a system
  containerd. Two things stay global in 1.6: the shim's socket is ``/run/containerd/s/<hash of
  the address and id>`` (so it cannot collide), and runc's state root, which ``ctr run
  --runc-root`` moves (``Containerd.ctr_run`` does).
* Images need no registry: a ``docker save``-format tar (``manifest.json``, an image config and
  one ``layer.tar``) loads with ``ctr images import``.
* ``ctr run --gpus N`` looks up ``nvidia-container-cli`` on *ctr's* PATH and registers it as a
  prestart hook through ``containerd oci-hook``; the hook's env is ctr's whole environment.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from integration.engines import RunResult, require_tool

#: A namespace of our own: containers, images and the v1 cgroup parent (/<namespace>/<id>) are apart.
NAMESPACE: Final = "gpuhook-test"
#: The /etc/containerd/config.toml Debian 12's containerd package ships (no `imports`), for tests that
#: register gpuhook with it on a copy, so the host's own file is never touched nor relied on.
DEBIAN_CONFIG: Final = """version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
"""
_READY_TIMEOUT_S: Final = 20.0
_STOP_TIMEOUT_S: Final = 10.0
_CGROUP_ROOT: Final = Path("/sys/fs/cgroup")


def write_docker_archive(rootfs: Path, out: Path, ref: str) -> Path:
    """Write *rootfs* as a one-layer ``docker save`` tar tagged *ref* (for ``ctr images import``)."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _walk(rootfs):
            # Numeric owners and no user names: the image must not depend on this host's passwd.
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(rootfs)))
            info.uname = info.gname = ""
            if info.isreg():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    layer_bytes = layer.getvalue()
    diff_id = hashlib.sha256(layer_bytes).hexdigest()
    config = {
        "architecture": "amd64" if os.uname().machine == "x86_64" else os.uname().machine,
        "os": "linux",
        "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
        "history": [{"created_by": "integration.containerd.write_docker_archive"}],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_name = f"{hashlib.sha256(config_bytes).hexdigest()}.json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [ref], "Layers": [f"{diff_id}/layer.tar"]}]).encode()
    with tarfile.open(out, mode="w") as tar:
        for name, data in ((f"{diff_id}/layer.tar", layer_bytes), (config_name, config_bytes),
                           ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return out


def _walk(root: Path) -> list[Path]:
    """Every entry under *root*, parents first, symlinks kept as links (never followed)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        found += [Path(dirpath, name) for name in sorted(dirnames + filenames)]
    return found


@dataclass
class Containerd:
    """One private containerd daemon under *base*; ``start()`` then ``stop()`` (always)."""

    base: Path
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(init=False)
    #: the opt plugin's directory (its default: /opt/containerd), whose lib/ it puts into every shim's LD_LIBRARY_PATH
    opt: Path | None = None
    #: the daemon's environment, which its shims and their runtime inherit (default: ours)
    env: dict[str, str] | None = None

    def __post_init__(self) -> None:
        """Derive the private paths."""
        self.log = self.base / "containerd.log"

    @property
    def address(self) -> Path:
        """The grpc socket (under *base*, never /run/containerd)."""
        return self.base / "containerd.sock"

    @property
    def runc_root(self) -> Path:
        """runc's state root for our containers (passed to ``ctr run --runc-root``)."""
        return self.base / "runc"

    def start(self) -> None:
        """Write the config, start the daemon and wait until ``ctr version`` answers."""
        binary = require_tool("containerd")
        require_tool("ctr")
        for name in ("root", "state", "runc"):
            (self.base / name).mkdir(parents=True, exist_ok=True)
        config = self.base / "config.toml"
        config.write_text(
            "version = 2\n"
            f'root = "{self.base / "root"}"\n'
            f'state = "{self.base / "state"}"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            "[grpc]\n"
            f'  address = "{self.address}"\n'
            "[ttrpc]\n"
            f'  address = "{self.base / "containerd.ttrpc.sock"}"\n'
            "[debug]\n"
            f'  address = "{self.base / "debug.sock"}"\n'
            + (f'[plugins."io.containerd.internal.v1.opt"]\n  path = "{self.opt}"\n' if self.opt else "")
        )
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([binary, "--config", str(config)], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd exited with {self.proc.returncode}: {self._log_tail()}")
            probe = self.ctr("version", timeout=5, check=False)
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"containerd not ready after {_READY_TIMEOUT_S} s: {probe.stderr.strip()}; "
                                   f"{self._log_tail()}")
            time.sleep(0.02)

    def ctr(self, *args: str, env: dict[str, str] | None = None, timeout: float = 60,
            check: bool = True) -> RunResult:
        """Run ``ctr --address A --namespace N ARGS``; *check* raises on a non-zero status."""
        argv = ["ctr", "--address", str(self.address), "--namespace", NAMESPACE, *args]
        started = time.monotonic()
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired as err:
            return RunResult(returncode=-1, stdout=_text(err.stdout), stderr=_text(err.stderr),
                             duration_s=time.monotonic() - started, timed_out=True)
        result = RunResult(returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr,
                           duration_s=time.monotonic() - started)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return result

    def import_rootfs(self, rootfs: Path, ref: str) -> str:
        """Import *rootfs* as image *ref* (through a docker-archive tar) and return *ref*."""
        archive = write_docker_archive(rootfs, self.base / "image.tar", ref)
        self.ctr("images", "import", str(archive))
        return ref

    def run(self, image: str, container_id: str, *command: str, options: tuple[str, ...] = (),
            env: dict[str, str] | None = None, timeout: float = 60) -> RunResult:
        """``ctr run --rm OPTIONS IMAGE ID COMMAND`` with runc's state under *base*; *env* is ctr's env."""
        return self.ctr("run", "--rm", "--runc-root", str(self.runc_root), *options, image, container_id,
                        *command, env=env, timeout=timeout, check=False)

    def stop(self) -> None:
        """Stop the daemon by pid, then remove its mounts, cgroups and state (also after a failed start)."""
        proc, self.proc = self.proc, None
        try:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=_STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=_STOP_TIMEOUT_S)
        finally:
            _unmount_under(self.base)
            _remove_namespace_cgroups()
            shutil.rmtree(self.base, ignore_errors=True)

    def _log_tail(self) -> str:
        """The end of the daemon's log, for error messages."""
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"


def _text(data: bytes | str | None) -> str:
    """subprocess output of a timed-out run as text."""
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def _unmount_under(base: Path) -> None:
    """Lazily unmount whatever a killed daemon or shim left mounted under *base* (deepest first)."""
    prefix = str(base.resolve()) + "/"
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def _remove_namespace_cgroups() -> None:
    """rmdir the empty /<namespace> cgroup parents runc made in each v1 hierarchy."""
    if not _CGROUP_ROOT.is_dir():
        return
    for hierarchy in _CGROUP_ROOT.iterdir():
        with contextlib.suppress(OSError):
            (hierarchy / NAMESPACE).rmdir()
