"""ctr run --gpus's hook served by gpuhookd: gpuhook-relay installed as ``nvidia-container-cli``.

ctr registers ``containerd oci-hook -- nvidia-container-cli --load-kmods configure --device=…
--compute --utility --pid={{pid}} {{rootfs}}`` as a prestart hook (runtime-lab.md §5); here the real
``containerd oci-hook`` fills in the pid and rootfs under real runc, and the CLI it execs is the relay
laid out as the packages install it, so gpuhookd does the start as it does a hook's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from integration.engines import require_tool
from integration.fakehost import FakeHost
from integration.gpuhookd import Gpuhookd
from integration.relay import relay_for

from .conftest import HOOK_ENV, MakeContainer
from .test_daemon import events_after, log_size
from .test_relay import run_relay

PROBE = "devopen /dev/nvidia1 /dev/nvidia0 /dev/nvidia-uvm; dltest libcuda.so.1"


def ctr_hook(relay: Path, host: FakeHost, socket: str, *configure: str) -> dict[str, Any]:
    """The prestart hook `ctr run --gpus 1` makes, running the relay under NVIDIA's CLI name."""
    cli = relay_for(relay, "nvidia-container-cli")
    args = ["containerd", "oci-hook", "--", str(cli), "--daemon-socket", socket, "--load-kmods", "configure",
            *configure, "--pid={{pid}}", "{{rootfs}}"]
    return {"path": require_tool("containerd"), "args": args, "env": [*HOOK_ENV, f"GPUHOOK_CONFIG={host.config_path}"]}


def test_configure_is_served_by_gpuhookd(make_container: MakeContainer, host: FakeHost, daemon: Gpuhookd,
                                         relay: Path) -> None:
    """configure --device=1 --compute --utility: the worker gives GPU 1 (and only it), as the CLI would."""
    offset = log_size(host)
    hook = ctr_hook(relay, host, daemon.socket, "--device=1", "--compute", "--utility")
    result = make_container(PROBE, {}, hook=hook).run()
    assert result.returncode == 0, result.stderr
    assert {"/dev/nvidia1 ENXIO", "/dev/nvidia0 ENOENT", "/dev/nvidia-uvm ENXIO", "dlopen libcuda.so.1: OK"} <= set(
        result.stdout.splitlines()), result.stdout
    events = events_after(host.root / "gpuhook.log", offset)
    assert {(e["served_by"], e.get("front_end")) for e in events} == {("gpuhookd", "nvidia-container-cli")}, events
    assert "applied" in [e["event"] for e in events]


def test_without_a_daemon_the_python_cli_does_it(make_container: MakeContainer, host: FakeHost, relay: Path) -> None:
    """--daemon-socket none (or no gpuhookd): the relay runs bin/nvidia-container-cli, which does the work."""
    offset = log_size(host)
    result = make_container(PROBE, {}, hook=ctr_hook(relay, host, "none", "--device=1", "--compute")).run()
    assert result.returncode == 0, result.stderr
    assert "/dev/nvidia1 ENXIO" in result.stdout.splitlines()
    assert {e["served_by"] for e in events_after(host.root / "gpuhook.log", offset)} == {"hook"}


def test_refusals_and_other_commands(make_container: MakeContainer, host: FakeHost, daemon: Gpuhookd,
                                     relay: Path) -> None:
    """A GPU the host lacks is refused by the worker with the CLI's message; a usage error is exit 2 with
    NVIDIA's usage line; --version is not GPU work (the Python CLI answers it)."""
    refused = make_container("echo started", {}, hook=ctr_hook(relay, host, daemon.socket, "--device=9")).run()
    assert refused.returncode != 0 and "started" not in refused.stdout
    assert "no GPU with index 9" in refused.stderr, refused.stderr
    cli = relay_for(relay, "nvidia-container-cli")
    usage = run_relay(cli, "--daemon-socket", daemon.socket, "configure", "--pid=abc", "/rootfs")
    assert usage.returncode == 2 and "--pid='abc': expected the decimal host pid" in usage.stderr, usage.stderr
    assert "usage: nvidia-container-cli" in usage.stderr
    version = run_relay(cli, "--daemon-socket", daemon.socket, "--version")
    assert version.returncode == 0 and version.stdout.startswith("cli-version: gpuhook"), version
