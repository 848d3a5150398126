"""Config loading: the shipped file, the lookup order, and refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuhook import config as config_module
from gpuhook.config import (
    DEFAULT_PATH,
    Config,
    HealthPolicy,
    LogLevel,
    load_config,
    parse_config,
    read_config_unchanged,
    resolve_config_path,
)
from gpuhook.errors import ConfigError

SHIPPED = Path(__file__).parents[2] / "config" / "gpuhook.yaml"


def test_shipped_config_is_the_defaults() -> None:
    """config/gpuhook.yaml documents exactly the built-in defaults, so it cannot rot."""
    assert load_config(SHIPPED, required=True) == Config()


def test_lookup_order() -> None:
    """--config beats $GPUHOOK_CONFIG beats the default path; only the default may be absent."""
    assert resolve_config_path("/a.yaml", {"GPUHOOK_CONFIG": "/b.yaml"}) == (Path("/a.yaml"), True)
    assert resolve_config_path(None, {"GPUHOOK_CONFIG": "/b.yaml"}) == (Path("/b.yaml"), True)
    assert resolve_config_path(None, {}) == (DEFAULT_PATH, False)


def test_missing_files(tmp_path: Path) -> None:
    """An explicit missing file is an error; a missing default gives the defaults."""
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", required=True)
    assert load_config(tmp_path / "nope.yaml", required=False) == Config()


def test_values_are_converted() -> None:
    """Paths become Paths, null log_file disables the log."""
    config = parse_config("driver_root: /run/nvidia/driver\nlog_file: null\nno_cgroups: true\n")
    assert config.driver_root == Path("/run/nvidia/driver")
    assert config.log_file is None
    assert config.no_cgroups is True


def test_cache_dir() -> None:
    """The inventory cache defaults to /run/gpuhook, moves with a path and is disabled by null."""
    assert Config().cache_dir == Path("/run/gpuhook")
    assert parse_config("cache_dir: /var/cache/gpuhook\n").cache_dir == Path("/var/cache/gpuhook")
    assert parse_config("cache_dir: null\n").cache_dir is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("unhealthy_gpus: warn\nlog_level: debug\n", (HealthPolicy.WARN, LogLevel.DEBUG), id="flat"),
        pytest.param("unhealthy_gpus: 'ignore'\nlog_level: \"error\"\n", (HealthPolicy.IGNORE, LogLevel.ERROR),
                     id="quoted"),
        pytest.param("{unhealthy_gpus: refuse, log_level: warning}\n", (HealthPolicy.REFUSE, LogLevel.WARNING),
                     id="pyyaml"),
        pytest.param("", (HealthPolicy.REFUSE, LogLevel.INFO), id="defaults"),
    ],
)
def test_policy_words_become_enum_members(text: str, expected: tuple[HealthPolicy, LogLevel]) -> None:
    """The YAML keeps its words; Config holds the members, whichever reader read the file."""
    config = parse_config(text)
    assert (config.unhealthy_gpus, config.log_level) == expected
    assert type(config.unhealthy_gpus) is HealthPolicy and type(config.log_level) is LogLevel


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("driver_rot: /\n", "unknown setting.*driver_rot", id="typo"),
        pytest.param("driver_root: relative\n", "driver_root must be an absolute path", id="relative"),
        pytest.param("cache_dir: run/gpuhook\n", "cache_dir must be an absolute path", id="relative-cache"),
        pytest.param("cache_dir: false\n", "cache_dir must be an absolute path", id="bool-cache"),
        pytest.param("no_cgroups: 'yes'\n", "no_cgroups must be true or false", id="string-bool"),
        pytest.param("log_level: loud\n", "log_level must be one of debug, info, warning, error, got 'loud'",
                     id="level"),
        pytest.param("log_level: 1\n", "log_level must be one of debug, info, warning, error, got 1", id="level-int"),
        pytest.param("log_level: INFO\n", "log_level must be one of", id="level-upper-case"),
        pytest.param("unhealthy_gpus: fail\n", "unhealthy_gpus must be one of refuse, warn, ignore, got 'fail'",
                     id="health"),
        pytest.param("unhealthy_gpus: [warn]\n", r"unhealthy_gpus must be one of .*got \['warn'\]",
                     id="health-list"),
        pytest.param("timeout_seconds: 0\n", "timeout_seconds", id="timeout"),
        pytest.param("- a\n", "expected a mapping", id="list"),
        pytest.param("a: [\n", "not valid YAML", id="yaml"),
    ],
)
def test_refusals(text: str, message: str) -> None:
    """Bad settings are refused with a message naming the key and the expectation."""
    with pytest.raises(ConfigError, match=message):
        parse_config(text)


@pytest.mark.parametrize(("text", "problem"), [
    pytest.param("log_level: info\nstate_dir: [a\ncache_dir: /x\n",
                 "at 3:10: did not find expected ',' or ']' (while parsing a flow sequence at 2:12)", id="flow"),
    pytest.param("a: b: c\n", "at 1:5: mapping values are not allowed in this context", id="mapping"),
    pytest.param('log_file: "\\q"\n', "at 1:12: found unknown escape character (while parsing a quoted scalar at 1:11)",
                 id="escape"),
    pytest.param("a: 1\n\tb: 2\n",
                 "at 2:1: found a tab character that violates indentation (while scanning a plain scalar at 1:4)",
                 id="tab"),
    pytest.param("log_level: info\nlog_file: /x\x01\n", "at 2:13: character 0x0001: control characters are not allowed",
                 id="control-character"),
])
def test_a_yaml_error_is_one_line_naming_the_file_and_place(tmp_path: Path, text: str, problem: str) -> None:
    """``gpuhook --config bad.yaml info``: one ``gpuhook:`` line with the file, line:column and the problem
    (PyYAML's own text spans four lines and names no file), exit 1."""
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    proc = subprocess.run([sys.executable, "-I", "-m", "gpuhook", "--config", str(config), "info"],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [f"gpuhook: {config}: not valid YAML {problem}"]


def test_flat_subset_reads_like_pyyaml() -> None:
    """The fast reader agrees with PyYAML on the shipped file, or defers to it."""
    import yaml

    from gpuhook.config import parse_flat_yaml

    assert parse_flat_yaml(SHIPPED.read_text()) == yaml.safe_load(SHIPPED.read_text())
    assert parse_flat_yaml('driver_root: "/run/nvidia/driver"\nlog_file: \'/var/log/x.log\'\n') == {
        "driver_root": "/run/nvidia/driver", "log_file": "/var/log/x.log"}
    for text in ("a: yes\n", "a: 1e3\n", "a: '/x'\n", "a: \"/x y\"\n", "a: 'it''s'\n", "a: \"\\t\"\n",
                 "a: \"#\" # c\n", "a: \"yes\"\n", "a:\n  - 1\n", "a: 1\na: 2\n", "---\na: 1\n", "a: 0x10\n",
                 "a: 2001-12-14\n", "a: .inf\n", "a: /x # c\n b: 1\n"):
        flat = parse_flat_yaml(text)
        assert flat is not None and (not isinstance(flat, dict) or flat == yaml.safe_load(text)), text
    for refused in ("_: \r\t#x\n", "\t# c\na: 1\n"):  # PyYAML refuses both: never read as flat
        with pytest.raises(yaml.YAMLError):
            yaml.safe_load(refused)
        assert not isinstance(parse_flat_yaml(refused), dict), refused


_KEYS = st.from_regex(r"[a-z_]{1,12}", fullmatch=True)
_VALUES = st.one_of(st.sampled_from(["", "~", "null", "true", "False", "TRUE", "debug", "0", "12", "30", "007",
                                     "yes", "on", "1.5", "-1", "x", "/run/nvidia/driver", "/a-b/c.d_e"]),
                    st.from_regex(r"/[A-Za-z0-9_./-]{0,20}", fullmatch=True), st.text(max_size=12),
                    st.from_regex(r"[\"'][ -~]{0,12}[\"']", fullmatch=True))


@given(st.lists(st.tuples(_KEYS, _VALUES, st.sampled_from(["", "  # note", "\t#x"])), max_size=6))
def test_flat_reader_never_disagrees_with_pyyaml(lines: list[tuple[str, str, str]]) -> None:
    """For any document, the fast reader either defers or returns exactly what PyYAML returns."""
    import yaml

    from gpuhook.config import parse_flat_yaml

    text = "".join(f"{key}: {value}{comment}\n" for key, value, comment in lines)
    flat = parse_flat_yaml(text)
    if isinstance(flat, dict) or flat is None:
        assert flat == yaml.safe_load(text)  # a document PyYAML refuses is never read as flat


# --- issue 15: state_dir, gpus, device_policy ------------------------------------------------------


def test_state_dir() -> None:
    """The lease ledger's directory defaults to /run/gpuhook, moves with a path (quoted too) and is disabled by
    null, which leaves the policy NVIDIA's."""
    assert Config().state_dir == Path("/run/gpuhook")
    assert Config().gpus.is_unlimited and Config().device_policy is None
    assert parse_config("state_dir: /var/lib/gpuhook\n").state_dir == Path("/var/lib/gpuhook")
    assert parse_config('state_dir: "/var/lib/gpuhook"\n').state_dir == Path("/var/lib/gpuhook")
    assert parse_config("state_dir: null\n").state_dir is None
    assert parse_config("state_dir: null\ngpus:\n  - {device: all, sharing: unlimited}\n").state_dir is None


def test_gpus_and_device_policy_keys(tmp_path: Path) -> None:
    """gpus: becomes the Policy; device_policy: names a file whose policy it becomes (gpus then stays unset)."""
    config = parse_config("gpus:\n  - device: 0\n    sharing: exclusive\n", source="/etc/gpuhook/config.yaml")
    assert [(e.device, e.sharing.value) for e in config.gpus.entries] == [("0", "exclusive")]
    assert config.gpus.source == "/etc/gpuhook/config.yaml"
    assert config.device_policy is None
    devices = tmp_path / "devices.json"
    devices.write_text('{"Devices": [{"DeviceID": "1", "Sharing": "shared", "Replicas": 3}]}')
    config = parse_config(f"device_policy: {devices}\n")
    assert config.device_policy == devices
    assert [(e.device, e.sharing.value, e.replicas) for e in config.gpus.entries] == [("1", "shared", 3)]
    assert parse_config("device_policy: null\n").gpus.is_unlimited


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("state_dir: run/gpuhook\n", "state_dir must be an absolute path", id="relative-state-dir"),
        pytest.param("state_dir: false\n", "state_dir must be an absolute path", id="bool-state-dir"),
        pytest.param("device_policy: devices.json\n", "device_policy must be an absolute path",
                     id="relative-device-policy"),
        pytest.param("device_policy: /nonexistent/devices.json\n",
                     "device_policy: cannot read /nonexistent/devices.json", id="missing-device-policy"),
        pytest.param("gpus: all\n", "gpus must be a list of GPU entries, got str", id="gpus-not-a-list"),
        pytest.param("gpus:\n  - device: 0\n    sharing: exclusive\n    replicas: 2\n",
                     r"gpus\[0\]: replicas contradicts sharing 'exclusive'", id="gpus-entry"),
        pytest.param("state_dir: null\ngpus:\n  - {device: 0, sharing: exclusive}\n",
                     "state_dir is null, but the sharing policy", id="state-dir-null-with-limits"),
        pytest.param("state_dir: /dev/shm/gpuhook\ngpus:\n  - {device: 0, sharing: mps, replicas: 2}\n",
                     "state_dir '/dev/shm/gpuhook' is in /dev/shm .*shares a GPU through MPS.*Fix: set state_dir "
                     "outside /dev/shm", id="mps-state-dir-in-dev-shm"),
        pytest.param("device_policy: /x.json\ngpus: []\n", "gpus and device_policy both set a sharing policy",
                     id="both-policies"),
        pytest.param("gpu:\n  - {device: 0}\n", "unknown setting.*gpu;", id="typo"),
    ],
)
def test_sharing_refusals(text: str, message: str) -> None:
    """The new keys are refused with a message naming the key."""
    with pytest.raises(ConfigError, match=message):
        parse_config(text)


def test_a_state_dir_in_dev_shm_is_refused_only_with_mps_and_through_a_symlink_too(tmp_path: Path) -> None:
    """The MPS daemon's own /dev/shm would hide a state_dir there; other policies keep any state_dir, and a
    symlink into /dev/shm is what it points to."""
    assert parse_config("state_dir: /dev/shm/gpuhook\ngpus:\n  - {device: 0, sharing: shared, replicas: 2}\n"
                        ).state_dir == Path("/dev/shm/gpuhook")
    assert parse_config("state_dir: /dev/shmx\ngpus:\n  - {device: 0, sharing: mps, replicas: 2}\n").state_dir
    link = tmp_path / "state"
    link.symlink_to("/dev/shm")
    with pytest.raises(ConfigError, match=f"state_dir '{link}' is in /dev/shm \\(/dev/shm\\)"):
        parse_config(f"state_dir: {link}\ngpus:\n  - {{device: 0, sharing: mps, replicas: 2}}\n")


def test_an_unchanged_config_is_read_once_and_any_change_is_read(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """gpuhookd loads its config per request: the same file gives the same answer without a read; a
    rewrite in place (same size, the old mtime put back), a replacement or a removal is read."""
    monkeypatch.setattr(config_module, "_SETTLED_NS", 0)  # every file is settled: what is remembered shows
    path = tmp_path / "gpuhook.yaml"
    path.write_text("log_level: debug\n")
    first = read_config_unchanged(path, required=True)
    assert read_config_unchanged(path, required=True) is first
    mtime = path.stat().st_mtime_ns
    path.write_text("log_level: error\n")  # same size, same inode
    os.utime(path, ns=(mtime, mtime))
    assert read_config_unchanged(path, required=True).config.log_level is LogLevel.ERROR
    replacement = tmp_path / "new.yaml"
    replacement.write_text("log_level: warning\n")
    replacement.replace(path)
    assert read_config_unchanged(path, required=True).config.log_level is LogLevel.WARNING
    path.unlink()
    with pytest.raises(ConfigError, match="does not exist"):
        read_config_unchanged(path, required=True)
    assert read_config_unchanged(path, required=False).config == Config()


def test_a_config_changed_just_now_is_never_remembered(tmp_path: Path) -> None:
    """Within the timestamp granularity an in-place rewrite can keep size and times: such a file is read
    every time (git's rule for racy index entries)."""
    path = tmp_path / "gpuhook.yaml"
    path.write_text("log_level: debug\n")
    before = path.stat()
    assert read_config_unchanged(path, required=True).config.log_level is LogLevel.DEBUG
    path.write_text("log_level: error\n")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert read_config_unchanged(path, required=True).config.log_level is LogLevel.ERROR
