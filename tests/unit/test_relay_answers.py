"""The calls gpuhook-relay answers itself (relay/answers.h): a no-GPU start, a poststop no lease names, a poststart.

They are the Python hook's own answers ported to C, so the Python functions are the oracle: over the same
configs, ledgers, ids, states and config.json files, the relay answers a poststop itself exactly where
hookcall.lease_may_exist says no lease (configs), and never answers a call the Python hook would read
otherwise or fail on (states, config.json: the relay may be stricter, and then gpuhookd answers). The relay
is built with its default paths (/etc/gpuhook/config.yaml, NVIDIA's config.toml, /run/gpuhook) moved into a
temporary directory; a fake gpuhookd answers every request with status 7, so 0 means "answered by the
relay" and 7 "forwarded". A no-GPU start it answers is still told to gpuhookd: a `no-gpu` notice.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuhook import hookcall
from gpuhook.daemon import wire
from gpuhook.errors import SpecError
from gpuhook.oci import strictjson
from gpuhook.request.quick import GPU_MARKERS
from tests.unit.test_relay import ROOT, FakeDaemon, Request, _need_root_and_gcc  # noqa: F401 - the autouse fixture

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

FORWARDED = 7
HELD, FREE = "held-ctr", "free-ctr"


#: Where the test build's compiled-in defaults are, under its root (relay/answers.h's three #defines).
DEFAULTS = {"DEFAULT_CONFIG": "etc-gpuhook-config.yaml", "NVIDIA_CONFIG": "etc-nvidia-config.toml",
            "DEFAULT_STATE_DIR": "run-gpuhook"}


@dataclass(frozen=True)
class Host:
    """The relay built with its defaults under *root* (bin/gpuhook-relay), and the fake gpuhookd it is pointed at."""

    root: Path
    daemon: FakeDaemon

    @property
    def relay(self) -> Path:
        return self.root / "bin" / "gpuhook-relay"

    @property
    def default_config(self) -> Path:
        return self.root / DEFAULTS["DEFAULT_CONFIG"]

    @property
    def nvidia_config(self) -> Path:
        return self.root / DEFAULTS["NVIDIA_CONFIG"]

    @property
    def default_state_dir(self) -> Path:
        return self.root / DEFAULTS["DEFAULT_STATE_DIR"]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    root = Path(os.path.realpath(tmp_path_factory.mktemp("answers")))
    (root / "bin").mkdir()
    defines = " ".join(f'-D{name}="{root / where}"' for name, where in DEFAULTS.items())
    subprocess.run([str(ROOT / "relay" / "build.sh"), str(root / "bin" / "gpuhook-relay")], check=True,
                   env={**os.environ, "RELAY_DEFINES": defines})
    daemon = FakeDaemon(root / "gpuhookd.sock", wire.encode_reply(b"done", FORWARDED, ""))
    yield Host(root, daemon)
    daemon.close()


@pytest.fixture
def python_defaults(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python oracle with the same default paths as the relay under test."""
    monkeypatch.setattr(hookcall, "_DEFAULT_CONFIG", str(host.default_config))
    monkeypatch.setattr(hookcall, "_NVIDIA_CONFIG", str(host.nvidia_config))
    monkeypatch.setattr(hookcall, "DEFAULT_STATE_DIR", str(host.default_state_dir))


@pytest.fixture(autouse=True)
def _clean_defaults(host: Host) -> Iterator[None]:
    yield
    for path in (host.default_config, host.nvidia_config, host.default_state_dir / hookcall.LEDGER_NAME):
        path.unlink(missing_ok=True)


def call(host: Host, args: list[str], state: bytes, env: dict[str, str] | None = None, *,
         program: Path | None = None, daemon_socket: Path | None = None) -> tuple[int, list[Request]]:
    """The relay's (or a copy's) exit status for this hook call, and the requests gpuhookd got for it (a
    notice arrives after the relay's exit: waited for, as a start answered with 0 sends one)."""
    before = len(host.daemon.requests)
    (host.root / "state").write_bytes(state)
    with open(host.root / "state", "rb") as stdin:
        argv = [str(program or host.relay), "--daemon-socket", str(daemon_socket or host.daemon.path), *args]
        proc = subprocess.run(argv, stdin=stdin, stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", **(env or {})},
                              timeout=20, check=False)
    assert proc.returncode in (0, FORWARDED), proc.stderr
    assert proc.stderr == b""
    deadline = time.monotonic() + 20
    while (daemon_socket is None and proc.returncode == 0 and args[-1:] in (["prestart"], ["createRuntime"])
           and len(host.daemon.requests) == before and time.monotonic() < deadline):
        time.sleep(0.005)  # a no-GPU start's notice: sent before the relay's exit, read by the thread after
    return proc.returncode, host.daemon.requests[before:]


def answered(host: Host, args: list[str], state: bytes, env: dict[str, str] | None = None) -> bool:
    """True: the relay answered this poststop (or poststart) itself, gpuhookd never asked; False: gpuhookd did."""
    status, requests = call(host, args, state, env)
    assert [r.kind for r in requests] == ([] if status == 0 else [b"relay"])
    return status == 0


def _state(container_id: str) -> bytes:
    return json.dumps({"ociVersion": "1.2.0", "id": container_id, "status": "stopped", "bundle": "/b",
                       "annotations": {"io.podman.annotations.autoremove": "TRUE"}}).encode()


def _ledger(state_dir: Path, *container_ids: str) -> None:
    """A ledger as gpuhook writes it (provision/ledger_store), holding *container_ids*."""
    from gpuhook.provision import ledger_store
    from gpuhook.sharing.ledger import Holder, Lease, Ledger

    def add(ledger: Ledger) -> tuple[Ledger, None]:
        for n, container_id in enumerate(container_ids):
            ledger = ledger.reserve(Lease(container_id=container_id, devices=(f"GPU-{n}",),
                                          holder=Holder(pid=100 + n, start=1), since="2026-12-01T12:00:00Z"))
        return ledger, None

    ledger_store.update(state_dir, add)


# --- configs: the relay decides exactly as lease_may_exist -------------------------------------------

#: Config files, {held}: a state_dir whose ledger names HELD, {empty}: one without a ledger. Every branch of
#: _flat_state_dir and _plain_path, both ways.
CONFIGS = [
    "state_dir: {held}\n", "state_dir: {empty}\n", "state_dir: {held}", "state_dir: \"{held}\"\n",
    "state_dir: '{empty}'\n", "state_dir: {held}  # the ledger\n", "state_dir:   {empty}   \n",
    "log_level: info\r\nstate_dir: {held}\r\ncache_dir: null\r\n", "log_level: info\rstate_dir: {empty}\r",
    "# gpuhook\n\nlog_level: debug\nstate_dir: {empty}\nmetrics:\n  listen: 127.0.0.1:9400\n",
    "state_dir: null\n", "state_dir: ~\n", "state_dir:\n", "state_dir: NULL\n", "state_dir: \"\"\n",
    "state_dir: #nothing\n", "log_level: debug\n", "", "\n\n",
    "state_dir: {held}\nstate_dir: {empty}\n", "{{state_dir: {empty}}}\n", "{{log_level: info,\nstate_dir: {empty}}}\n",
    "state_dir: \"{empty}\\u0041\"\n", "\"state_dir\": {empty}\n", "state_dir: !!str {empty}\n",
    "state_dir: &s {empty}\n", "  state_dir: {empty}\n", "state_dir: relative/dir\n", "# state_dir: {empty}\n",
    "state_dir: {empty}\n# state_dir used to be elsewhere\n", "state_dir: {empty}\t# tab\n",
    "log_file: /var/log/state_dir.log\n", "state_dir: {empty}\n  x\n", "state_dir:\n  {empty}\n",
    "state_dir: {empty}\n\nlog_level: info\n", "state_dir: {empty}\n#later\n", "state_dirs: {empty}\n",
    "xstate_dir: {empty}\n", "state_dir:{empty}\n", "state_dir: {empty}:x\n", "state_dir: {empty}é\n",
    "log_level: é\nstate_dir: {empty}\n", "%YAML 1.1\n---\nstate_dir: {empty}\n", "---\nstate_dir: {empty}\n",
    "State_dir: {empty}\n", "state_dir: \"{empty}\n", "state_dir: {empty}\x01\n", "state_dir: ' {empty}'\n",
    "# pad\n" * 200_000 + "state_dir: {empty}\n",  # over 1 MiB: its head could hide the line that follows
    # quoted, so strings (the full load refuses them), not null; a null state_dir beside a sharing policy
    "state_dir: ''\n", "state_dir: 'null'\n", "state_dir: \"~\"\n", "state_dir: \"NULL\"  # x\n",
    "state_dir: null\ngpus: [{{device: 0, sharing: exclusive}}]\n", "device_policy: {empty}/p.json\nstate_dir:\n",
]


def _loader_refuses_state_dir(config: Path) -> bool:
    """Whether the real config loader refuses *config* for its state_dir (it may refuse other settings too)."""
    from gpuhook.config import read_config
    from gpuhook.errors import ConfigError

    try:
        read_config(config, required=True)
    except ConfigError as err:
        return str(err).startswith(f"{config}: state_dir")
    return False


@pytest.mark.usefixtures("python_defaults")
@pytest.mark.parametrize("template", CONFIGS, ids=[f"config{n}" for n in range(len(CONFIGS))])
def test_the_config_is_read_as_the_python_hook_reads_it(host: Host, tmp_path: Path, template: str) -> None:
    held, empty = tmp_path / "held", tmp_path / "empty"
    _ledger(held, HELD)
    empty.mkdir()
    config = tmp_path / "gpuhook.yaml"
    config.write_bytes(template.format(held=held, empty=empty).encode())
    _ledger(host.default_state_dir, HELD)
    refused = _loader_refuses_state_dir(config)
    for container_id in (HELD, FREE, "held"):  # "held": a prefix of a held id is not held
        expected = not hookcall.lease_may_exist(str(config), {}, container_id)
        assert answered(host, ["--config", str(config), "poststop"], _state(container_id)) is expected, container_id
        assert not (expected and refused), "a config the loader refuses is answered as if it held no lease"


@pytest.mark.usefixtures("python_defaults")
def test_the_config_is_found_as_the_python_hook_finds_it(host: Host, tmp_path: Path) -> None:
    """--config (either spelling) beats $GPUHOOK_CONFIG, which beats the default; a named config must exist."""
    held, empty = tmp_path / "held", tmp_path / "empty"
    _ledger(held, HELD)
    empty.mkdir()
    (tmp_path / "a.yaml").write_text(f"state_dir: {held}\n")
    (tmp_path / "b.yaml").write_text(f"state_dir: {empty}\n")
    a, b = {"GPUHOOK_CONFIG": str(tmp_path / "a.yaml")}, {"GPUHOOK_CONFIG": str(tmp_path / "b.yaml")}
    cases = [
        (["poststop"], a), (["poststop"], b), (["--config", str(tmp_path / "b.yaml"), "poststop"], a),
        ([f"--config={tmp_path / 'b.yaml'}", "poststop"], a), (["--config=", "poststop"], b),
        (["--config", str(tmp_path / "absent.yaml"), "poststop"], {}), (["poststop"], {"GPUHOOK_CONFIG": ""}),
        (["--debug", "--config", str(tmp_path / "b.yaml"), "--debug", "poststop"], {}),
        (["--config", str(tmp_path), "poststop"], {}),  # a directory: unreadable
    ]
    for args, env in cases:
        parsed = hookcall.parse_hook_argv(["--daemon-socket", "s", *args])
        assert parsed is not None
        expected = not hookcall.lease_may_exist(parsed.config, env, HELD)
        assert answered(host, args, _state(HELD), env) is expected, (args, env)
    assert answered(host, ["poststop"], _state(HELD), b) is True  # the cases above answered both ways
    assert answered(host, ["poststop"], _state(HELD), a) is False


@pytest.mark.usefixtures("python_defaults")
@pytest.mark.parametrize("own", [None, "", "log_level: info\n"])
@pytest.mark.parametrize("nvidia", [None, "[nvidia-container-cli]\nldconfig = \"@/sbin/ldconfig\"\n",
                                    "[gpuhook]\nstate_dir = \"{empty}\"\n", "[gpuhook]\n\"st\\u0061te_dir\" = 1\n"])
def test_without_its_own_config_nvidias_is_read(host: Host, tmp_path: Path, own: str | None,
                                                nvidia: str | None) -> None:
    """No (or an empty) /etc/gpuhook/config.yaml: NVIDIA's config.toml may move state_dir, and then the full
    path reads it; a config of its own is never mixed with NVIDIA's."""
    (tmp_path / "empty").mkdir()
    _ledger(host.default_state_dir, HELD)
    if own is not None:
        host.default_config.write_text(own)
    if nvidia is not None:
        host.nvidia_config.write_text(nvidia.format(empty=tmp_path / "empty"))
    for container_id in (HELD, FREE):
        expected = not hookcall.lease_may_exist(None, {}, container_id)
        assert answered(host, ["poststop"], _state(container_id)) is expected, container_id


@pytest.mark.usefixtures("python_defaults")
def test_an_unreadable_ledger_goes_to_gpuhookd(host: Host, tmp_path: Path) -> None:
    """A ledger path that is a directory (or any read error) leaves doubt; an absent one does not."""
    config = tmp_path / "gpuhook.yaml"
    config.write_text(f"state_dir: {tmp_path}\n")
    assert answered(host, ["--config", str(config), "poststop"], _state(FREE)) is True
    (tmp_path / hookcall.LEDGER_NAME).mkdir()
    assert hookcall.lease_may_exist(str(config), {}, FREE) is True
    assert answered(host, ["--config", str(config), "poststop"], _state(FREE)) is False


# --- argv and state: only gpuhook's own poststop of a state certainly valid --------------------------


@pytest.mark.usefixtures("python_defaults")
@pytest.mark.parametrize("args", [
    ["prestart"], ["createRuntime"], ["--bogus", "poststop"], ["poststop", "extra"],
    ["--config", "-x", "poststop"], ["--config"], [],
])
def test_other_calls_go_to_gpuhookd(host: Host, args: list[str]) -> None:
    """Another stage (a start of a bundle without config.json: /b), another argv: gpuhookd decides."""
    assert not (host.default_state_dir / hookcall.LEDGER_NAME).exists()
    assert answered(host, args, _state(FREE)) is False
    assert answered(host, ["poststop"], _state(FREE)) is True  # the same state, config and ledger


def test_a_copy_under_nvidias_name_goes_to_gpuhookd(host: Host) -> None:
    """NVIDIA's flags are translated by the full path only."""
    program = host.root / "bin" / "nvidia-container-runtime-hook-relay"
    program.write_bytes(host.relay.read_bytes())
    program.chmod(0o755)
    status, requests = call(host, ["poststop"], _state(FREE), program=program)
    assert (status, [r.kind for r in requests]) == (FORWARDED, [b"relay"])


#: The state test_no_mutated_state_is_answered_that_the_decoder_refuses edits.
_SEED = (b'{"ociVersion": "1.2.0", "id": "free-ctr", "status": "stopped", "pid": 0, "bundle": "/b", '
         b'"annotations": {"a": "b \\" \\u00e9", "n": [1, -2.5e+3, true, false, null, {}]}}')

#: States the relay answers: valid JSON objects with a plain top-level id, as runtimes write them.
ANSWERED = [
    _SEED, _state(FREE), b'{"id":"free-ctr"}', b' \t\r\n{ "id" : "free-ctr" , "pid" : 0 }\n ',
    b'{"a": [1, -2.5e+3, 0, true, false, null, {"id": 1}, [], {}], "id": "free-ctr", "b": {"c": {"d": "x"}}}',
    b'{"id": "free-ctr", "annotations": {"k": "v \\" \\\\ \\/ \\b \\f \\n \\r \\t \\u00e9"}}',
    b'{"id": "Free_ctr.0-9"}', b'{"id": "free-ctr", "n": -0, "m": 1E5, "o": 0.5}',
]

#: States it leaves to gpuhookd: invalid (the full path says why), or valid but not certainly plain.
FORWARDED_STATES = [
    b"", b"{}", b"[]", b'"free-ctr"', b'{"id": "free-ctr"', b'{"id": "free-ctr"} x', b'{"id": "free-ctr"}{}',
    b'{"id": "free-ctr", "id": "free-ctr"}', b'{"id": "free-ctr", "a": {"b": 1, "b": 2}}',
    b'{"id": "fr\\u0065e-ctr"}', b'{"id": "free/ctr"}', b'{"id": "free ctr"}', b'{"id": ""}', b'{"id": 1}',
    b'{"id": null}', b'{"id": ["free-ctr"]}', b'{"id": "free-ctr", "n": NaN}', b'{"id": "free-ctr", "n": 01}',
    b'{"id": "free-ctr", "n": 1.}', b'{"id": "free-ctr", "n": .5}', b'{"id": "free-ctr", "n": +1}',
    b'{"id": "free-ctr", "n": 1e}', b'{"id": "free-ctr", "n": -}', b'{"id": "free-ctr", "n": Infinity}',
    b'{"id": "free-ctr", "a": "\xc3\xa9"}', b'\xef\xbb\xbf{"id": "free-ctr"}', b'{"id": "free-ctr", "a": "\x01"}',
    b'{"id": "free-ctr", "a": "\\q"}', b'{"id": "free-ctr", "a": "\\u12"}', b'{"id": "free-ctr", "a": "\\',
    b'{"id": "free-ctr", "\\u0069d": "x"}', b'{"id": "free-ctr",}', b'{"id": "free-ctr", "a": [1,]}',
    b'{"id": "free-ctr" "a": 1}', b'{"id" "free-ctr"}', b'{id: "free-ctr"}', b"{'id': 'free-ctr'}",
    b'{"id": "free-ctr", "a": tru}', b'{"id": "free-ctr", "a": nul}', b'{"id": "free-ctr"}\0',
    b'{"id": "free-ctr", "n": ' + b"1" * 5000 + b"}", b'{"id": "free-ctr", "a": ' + b"[" * 100 + b"]" * 100 + b"}",
    b'{"id": "free-ctr", "pad": "' + b"x" * (1 << 20) + b'"}',  # over the state limit
]


@pytest.mark.usefixtures("python_defaults")
@pytest.mark.parametrize("state", ANSWERED, ids=[f"answered{n}" for n in range(len(ANSWERED))])
def test_states_runtimes_write_are_answered(host: Host, state: bytes) -> None:
    assert answered(host, ["poststop"], state) is True


def _python_would_answer(state: bytes) -> bool:
    """Whether the Python hook answers this poststop without the full path (no ledger anywhere)."""
    try:
        container_id = strictjson.loads_object(state, what="state", limit=strictjson.STATE_LIMIT).get("id")
    except SpecError:
        return False
    return isinstance(container_id, str) and not hookcall.lease_may_exist(None, {}, container_id)


@pytest.mark.usefixtures("python_defaults")
@pytest.mark.parametrize("state", FORWARDED_STATES, ids=[f"forwarded{n}" for n in range(len(FORWARDED_STATES))])
def test_any_other_state_goes_to_gpuhookd(host: Host, state: bytes) -> None:
    assert answered(host, ["poststop"], state) is False


@pytest.mark.usefixtures("python_defaults")
def test_the_relay_answers_no_state_the_python_hook_would_not(host: Host) -> None:
    """Soundness over both lists: every state the relay answers, the Python hook answers too; and the lists
    hold both kinds (some forwarded states are valid JSON the relay is merely stricter about)."""
    for state in ANSWERED:
        assert _python_would_answer(state), state
    invalid = [state for state in FORWARDED_STATES if not _python_would_answer(state)]
    stricter = [state for state in FORWARDED_STATES if _python_would_answer(state)]
    assert len(invalid) > 30
    assert b'{"id": "free-ctr", "a": "\xc3\xa9"}' in stricter  # non-ASCII: valid, left to gpuhookd


# --- starts: a config.json without GPU_MARKERS is answered, and gpuhookd told ---------------------------


def _bundle(tmp_path: Path, spec: bytes | None, name: str = "bundle") -> Path:
    bundle = tmp_path / name
    bundle.mkdir()
    if spec is not None:
        (bundle / "config.json").write_bytes(spec)
    return bundle


def _start_state(bundle: Path | str, container_id: str = FREE, key: str = "bundle") -> bytes:
    return json.dumps({"ociVersion": "1.2.0", "id": container_id, "status": "creating", "pid": 4242,
                       key: str(bundle)}).encode()


NO_GPU_SPEC = json.dumps({"ociVersion": "1.2.0", "process": {"args": ["sh"], "env": ["PATH=/bin", "HOME=/"]},
                          "root": {"path": "rootfs"}, "annotations": {"org.opencontainers.image.title": "x"}}).encode()


def _python_start(state: bytes) -> bool | None:
    """The Python hook's reading of this start: True (asks for a GPU), False (no GPU), None (an error)."""
    try:
        found = hookcall.read_hook_call(hookcall.HookArgs("prestart", None, False, None), {}, state)
    except SpecError:
        return None
    return found.asks_gpu


@pytest.mark.parametrize("stage", ["prestart", "createRuntime"])
def test_a_start_without_gpu_markers_is_answered_and_gpuhookd_told(host: Host, tmp_path: Path, stage: str) -> None:
    """Exit 0 at once; gpuhookd gets a `no-gpu` notice naming the container (no fds, no reply awaited)."""
    state = _start_state(_bundle(tmp_path, NO_GPU_SPEC))
    assert _python_start(state) is False
    status, requests = call(host, [stage], state)
    assert status == 0
    assert [(r.kind, r.parts, r.fd_links) for r in requests] == [(wire.NO_GPU, [FREE.encode()], [])]


@pytest.mark.parametrize("marker", GPU_MARKERS)
def test_any_gpu_marker_goes_to_gpuhookd(host: Host, tmp_path: Path, marker: bytes) -> None:
    """One marker anywhere (a value, a key, an annotation, a comment-like string): gpuhookd decides."""
    spec = NO_GPU_SPEC.replace(b'"HOME=/"', b'"HOME=/' + marker.replace(b"\\", b"\\\\") + b'"')
    if marker == b"\\u":
        spec = NO_GPU_SPEC.replace(b'"HOME=/"', b'"HOME=\\u002f"')
    assert marker in spec
    state = _start_state(_bundle(tmp_path, spec))
    status, requests = call(host, ["prestart"], state)
    assert (status, [r.kind for r in requests]) == (FORWARDED, [b"relay"])


def test_the_markers_are_the_python_hooks() -> None:
    """relay/answers.h's gpu_markers are quick.GPU_MARKERS (the C string literals, read)."""
    source = (ROOT / "relay" / "answers.h").read_text()
    line = next(line for line in source.splitlines() if line.startswith("static const char *const gpu_markers[]"))
    literals = [part.encode().decode("unicode_escape").encode() for part in line.split('"')[1::2]]
    assert tuple(literals) == GPU_MARKERS


#: config.json as the relay does not read it: gpuhookd (or the Python hook) opens it, and says what is wrong.
SPEC_FILES: dict[str, Callable[[Path, Path], object]] = {
    "missing": lambda path, good: None,
    "directory": lambda path, good: path.mkdir(),
    "symlink": lambda path, good: path.symlink_to(good),
    "fifo": lambda path, good: os.mkfifo(path),
    "over-the-limit": lambda path, good: path.write_bytes(
        NO_GPU_SPEC[:-1] + b', "pad": "' + b"x" * strictjson.SPEC_LIMIT + b'"}'),
}


@pytest.mark.parametrize("case", SPEC_FILES)
def test_a_config_json_it_does_not_read_goes_to_gpuhookd(host: Host, tmp_path: Path, case: str) -> None:
    good = _bundle(tmp_path, NO_GPU_SPEC, "good") / "config.json"
    bundle = _bundle(tmp_path, None)
    SPEC_FILES[case](bundle / "config.json", good)
    status, requests = call(host, ["prestart"], _start_state(bundle))
    assert (status, [r.kind for r in requests]) == (FORWARDED, [b"relay"])


#: Start states (their bundle's config.json asks for no GPU) whose bundle or id the relay does not take.
START_STATES: dict[str, Callable[[Path], bytes]] = {
    "relative-bundle": lambda good: _start_state(os.path.relpath(good)),
    "escaped-bundle": lambda good: _start_state(good).replace(b"/good", b"/goo\\u0064"),
    "bundle-not-a-string": lambda good: json.dumps({"id": FREE, "bundle": 1, "bundlePath": str(good)}).encode(),
    "no-bundle": lambda good: json.dumps({"id": FREE}).encode(),
    "bundle-over-bundlePath": lambda good: json.dumps(
        {"id": FREE, "bundle": str(good.parent / "bundle"), "bundlePath": str(good)}).encode(),
    "no-id": lambda good: json.dumps({"bundle": str(good)}).encode(),
    "id-not-plain": lambda good: _start_state(good, "a/b"),
    "id-too-long": lambda good: _start_state(good, "c" * 257),
    "invalid-state": lambda good: _start_state(good)[:-1],
}


@pytest.mark.parametrize("case", START_STATES)
def test_a_start_state_it_is_not_certain_of_goes_to_gpuhookd(host: Host, tmp_path: Path, case: str) -> None:
    """Whatever the Python hook would refuse, or log under an id the relay does not send: gpuhookd."""
    good = _bundle(tmp_path, NO_GPU_SPEC, "good")
    _bundle(tmp_path, None)  # "bundle": no config.json
    status, requests = call(host, ["prestart"], START_STATES[case](good))
    assert (status, [r.kind for r in requests]) == (FORWARDED, [b"relay"])


def test_bundle_path_is_read_without_bundle(host: Host, tmp_path: Path) -> None:
    """runc's older states say bundlePath: read as the Python hook reads it."""
    state = _start_state(_bundle(tmp_path, NO_GPU_SPEC), key="bundlePath")
    assert _python_start(state) is False
    status, requests = call(host, ["prestart"], state)
    assert (status, [r.kind for r in requests]) == (0, [wire.NO_GPU])


def test_without_gpuhookd_a_no_gpu_start_still_answers(host: Host, tmp_path: Path) -> None:
    """No daemon to tell: exit 0 all the same (the Python hook it would fall back to answers 0, unlogged), and
    nothing beside the relay was run (there is no Python hook beside this build: running it would fail)."""
    state = _start_state(_bundle(tmp_path, NO_GPU_SPEC))
    assert call(host, ["prestart"], state, daemon_socket=tmp_path / "absent.sock") == (0, [])
    assert not (host.root / "bin" / "gpuhook").exists()


def test_a_poststart_is_answered_whatever_its_state(host: Host) -> None:
    """poststart does nothing (hookcall.NOTHING): not even its state is decoded, by either."""
    assert hookcall.read_hook_call(hookcall.HookArgs("poststart", None, False, None), {}, b"not json").state == {}
    assert answered(host, ["poststart"], b"not json") is True


def _with_bundle(state: bytes, bundle: Path) -> bytes:
    """*state* with a top-level "bundle" naming *bundle* (in place of _state's "/b"; else first)."""
    quoted = json.dumps(str(bundle)).encode()
    if b'"bundle": "/b"' in state:
        return state.replace(b'"/b"', quoted)
    body = state.lstrip(b" \t\r\n")
    return state[:len(state) - len(body)] + b'{"bundle": ' + quoted + b", " + body[1:] if body[:1] == b"{" else state


@pytest.mark.parametrize("state", ANSWERED, ids=[f"answered{n}" for n in range(len(ANSWERED))])
def test_start_states_runtimes_write_are_answered(host: Host, tmp_path: Path, state: bytes) -> None:
    """The same states as a poststop's, with a bundle: answered, and the Python hook agrees."""
    state = _with_bundle(state, _bundle(tmp_path, NO_GPU_SPEC))
    assert _python_start(state) is False
    assert call(host, ["prestart"], state)[0] == 0


@pytest.mark.parametrize("state", FORWARDED_STATES, ids=[f"forwarded{n}" for n in range(len(FORWARDED_STATES))])
def test_start_states_it_is_not_certain_of_go_to_gpuhookd(host: Host, tmp_path: Path, state: bytes) -> None:
    state = _with_bundle(state, _bundle(tmp_path, NO_GPU_SPEC))
    assert call(host, ["prestart"], state)[0] == FORWARDED


# --- the scanner against the decoder, on mutated states -------------------------------------------------

#: Bytes that matter to a JSON scanner, and a few that must never pass.
_EDIT_BYTES = b'{}[]":,\\ \t\n0123456789.eE+-tfnrulsaxidu\x00\x01\x7f\xc3\xa9'


@given(edits=st.lists(st.tuples(st.integers(0, len(_SEED)), st.sampled_from(("insert", "replace", "delete")),
                                st.sampled_from(list(_EDIT_BYTES))), min_size=1, max_size=4))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_mutated_state_is_answered_that_the_decoder_refuses(host: Host, edits: list[tuple[int, str, int]]) -> None:
    """Whatever a few byte edits make of a valid state (which the relay answers: ANSWERED), the relay answers its
    poststop (no ledger anywhere) only when strictjson decodes it and its id is plain: the relay's scanner is
    never more lenient than the decoder."""
    state = bytearray(_SEED)
    for where, edit, byte in edits:
        at = min(where, len(state))
        if edit == "insert":
            state[at:at] = bytes([byte])
        elif at < len(state):
            state[at:at + 1] = b"" if edit == "delete" else bytes([byte])
    config = host.root / "plain.yaml"  # state_dir: the default, without a ledger
    config.write_text("log_level: info\n")
    assert not (host.default_state_dir / hookcall.LEDGER_NAME).exists()
    if answered(host, ["--config", str(config), "poststop"], bytes(state)):  # ~1 in 5 here: whitespace, digits
        decoded = strictjson.loads_object(bytes(state), what="state", limit=strictjson.STATE_LIMIT)
        assert isinstance(decoded.get("id"), str)
        assert hookcall._plain(decoded["id"])


_CONFIG_LINES = ["state_dir: {held}", "state_dir: {empty}", "state_dir: '{held}'", "state_dir: {held} # c",
                 "state_dir:", "state_dir: ~", "log_level: info", "# state_dir: {held}", "", "  x: 1", "\tx",
                 "metrics:", "  listen: 127.0.0.1:9400", "\"state_dir\": {held}", "- state_dir", "state_dir:{held}",
                 "gpus: [{{device: 0}}]", "{{state_dir: {held}}}", "x: \\u0041", "state_dirs: 1", "é: 1",
                 "state_dir: ''", "state_dir: \"null\""]


@pytest.mark.usefixtures("python_defaults")
@given(lines=st.lists(st.sampled_from(_CONFIG_LINES), max_size=5),
       breaks=st.lists(st.sampled_from(["\n", "\r\n", "\r", "\n\n"]), min_size=5, max_size=5),
       trailing=st.booleans())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_configs_made_of_such_lines_are_read_as_the_python_hook_reads_them(
        host: Host, lines: list[str], breaks: list[str], trailing: bool) -> None:
    """Any few of those lines, any line breaks: the relay and lease_may_exist agree, for a held id and a free one."""
    held, empty = host.root / "fuzz-held", host.root / "fuzz-empty"
    if not held.exists():
        _ledger(held, HELD)
        empty.mkdir()
    text = "".join(line + brk for line, brk in zip(lines, breaks, strict=False))
    text = text if trailing else text.rstrip("\r\n")
    config = host.root / "fuzz.yaml"
    config.write_bytes(text.format(held=held, empty=empty).encode())
    for container_id in (HELD, FREE):
        expected = not hookcall.lease_may_exist(str(config), {}, container_id)
        assert answered(host, ["--config", str(config), "poststop"], _state(container_id)) is expected, text
