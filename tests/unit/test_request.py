"""NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES and friends → GpuRequest."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import contextlib

from gpuhook.errors import RequestError
from gpuhook.oci.spec import BundleSpec, MountSpec
from gpuhook.request.grammar import (
    ACCEPTED_FORMS, CdiName, ChannelId, ChannelList, DeviceList, GpuCount, Keyword, Unknown, channel_token,
    decode_channels, decode_devices, decode_mig_control, device_token, entries,
)
from gpuhook.request.model import (
    ALL_CAPABILITIES, DEFAULT_CAPABILITIES, Capability, DeviceId, GpuIndex, GpuUuid, MigAsk, MigIndex, MigUuid,
    RequestSource,
)
from gpuhook.request.parse import parse_capabilities, parse_request
from gpuhook.request.quick import asks_for_gpu

UUID = "GPU-1a2b3c4d-0000-1111-2222-333344445555"
MIG = "MIG-1a2b3c4d-0000-1111-2222-333344445555"


def spec(env: dict[str, str], *, privileged: bool = False, mounts: tuple[MountSpec, ...] = ()) -> BundleSpec:
    """A bundle spec with just what the parser reads."""
    return BundleSpec(env=env, rootfs=Path("/r"), privileged=privileged, mounts=mounts)


def raw(env: dict[str, str], mounts: tuple[MountSpec, ...] = ()) -> dict[str, object]:
    """The config.json object the fast path sees."""
    return {"process": {"env": [f"{k}={v}" for k, v in env.items()]},
            "mounts": [{"destination": m.destination, "source": m.source, "type": m.type} for m in mounts]}


def request(env: dict[str, str], **kw: bool):  # type: ignore[no-untyped-def]
    """parse_request with NVIDIA's default policy unless overridden."""
    policy = {"accept_envvar_when_unprivileged": True, "accept_volume_mounts": False} | kw
    return parse_request(spec(env, privileged=bool(kw.get("privileged"))), **{
        k: v for k, v in policy.items() if k != "privileged"})


def parse_visible_devices(raw: str) -> DeviceList | None:
    """The grammar's device decoder, as NVIDIA_VISIBLE_DEVICES uses it."""
    return decode_devices(raw, source="NVIDIA_VISIBLE_DEVICES")


def listed(*devices: DeviceId, all_devices: bool = False) -> DeviceList:
    """A DeviceList, briefly."""
    return DeviceList(all_devices=all_devices, devices=devices)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param("", None, id="empty-is-void"),
        pytest.param(" , ,", None, id="only-commas-is-void"),
        pytest.param("void", None, id="void"),
        pytest.param("0,void", None, id="void-anywhere-wins"),
        pytest.param("all", listed(all_devices=True), id="all"),
        pytest.param("none", listed(), id="none"),
        pytest.param("0,all", listed(all_devices=True), id="all-in-list"),
        pytest.param("none,all", listed(), id="first-of-all-none-wins"),
        pytest.param("x,all", listed(all_devices=True), id="all-decides-before-entries-are-judged"),
        pytest.param("1, 3", listed(GpuIndex(1), GpuIndex(3)), id="indices-trimmed"),
        pytest.param("1,1", listed(GpuIndex(1)), id="duplicates-dropped"),
        pytest.param("GPU-" + UUID[4:].upper(), listed(GpuUuid("GPU-" + UUID[4:].upper())), id="gpu-uuid"),
        pytest.param(MIG, listed(MigUuid(MIG)), id="mig-uuid"),
        pytest.param(f"MIG-{UUID}/1/0", listed(MigUuid(f"MIG-{UUID}/1/0")), id="legacy-mig-uuid"),
        pytest.param("0:1", listed(MigIndex(0, 1)), id="mig-index"),
        pytest.param("\t2 ,0:1,\n", listed(GpuIndex(2), MigIndex(0, 1)), id="blanks-and-empty-entries"),
    ],
)
def test_visible_devices(raw: str, expected: object) -> None:
    """Every form of NVIDIA's contract (nvidia-toolkit.md §2.1)."""
    assert parse_visible_devices(raw) == expected


@pytest.mark.parametrize(
    "raw",
    ["٣", "1_0", "+3", "-1", "0x1", "GPU-1234", "gpu-" + UUID[4:], "00000", "0:", ":1", "all;rm", "nvidia0", "cdi/x=y"],
)
def test_malformed_devices_are_refused_by_name(raw: str) -> None:
    """Anything outside the grammar is refused with a message that names the value."""
    with pytest.raises(RequestError) as excinfo:
        parse_visible_devices(raw)
    assert repr(raw) in str(excinfo.value)


@pytest.mark.parametrize(
    ("entry", "token"),
    [
        pytest.param("all", Keyword.ALL, id="all"),
        pytest.param("none", Keyword.NONE, id="none"),
        pytest.param("void", Keyword.VOID, id="void"),
        pytest.param("ALL", Unknown("ALL"), id="keywords-are-lower-case"),
        pytest.param("7", GpuIndex(7), id="index"),
        pytest.param("0007", GpuIndex(7), id="index-four-digits"),
        pytest.param("00000", Unknown("00000"), id="index-five-digits"),
        pytest.param("٣", Unknown("٣"), id="index-non-ascii-digit"),
        pytest.param(UUID, GpuUuid(UUID), id="gpu-uuid"),
        pytest.param(UUID[:-1], Unknown(UUID[:-1]), id="gpu-uuid-short"),
        pytest.param(MIG, MigUuid(MIG), id="mig-uuid"),
        pytest.param(f"MIG-{UUID}/1/0", MigUuid(f"MIG-{UUID}/1/0"), id="legacy-mig-uuid"),
        pytest.param("1:2", MigIndex(1, 2), id="mig-index"),
        pytest.param("1:2:3", Unknown("1:2:3"), id="mig-index-three-parts"),
        pytest.param("nvidia.com/gpu=0", CdiName("nvidia.com/gpu=0"), id="cdi-qualified-name"),
        pytest.param("cdi/gpu0", CdiName("cdi/gpu0"), id="cdi-prefix"),
        pytest.param("nvidia0", Unknown("nvidia0"), id="node-name"),
    ],
)
def test_device_tokens(entry: str, token: object) -> None:
    """Each entry becomes exactly one typed token; entries outside the grammar are tokens too."""
    assert device_token(entry) == token
    assert type(device_token(entry)) is type(token)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param("0,x", f"NVIDIA_VISIBLE_DEVICES='0,x': 'x' is not a device; expected {ACCEPTED_FORMS}",
                     id="unknown"),
        pytest.param(" y ,x", f"NVIDIA_VISIBLE_DEVICES=' y ,x': 'y' is not a device; expected {ACCEPTED_FORMS}",
                     id="first-bad-entry-trimmed"),
        pytest.param("0,nvidia.com/gpu=1",
                     "NVIDIA_VISIBLE_DEVICES='0,nvidia.com/gpu=1': 'nvidia.com/gpu=1' is a CDI device name; gpuhook's "
                     "hook takes indices or UUIDs. Fix: request the GPU by index or UUID, or let a CDI-aware engine "
                     "apply the CDI spec", id="cdi-name"),
    ],
)
def test_device_refusals(raw: str, message: str) -> None:
    """A refusal names the source, the whole value and the first entry outside the grammar."""
    with pytest.raises(RequestError) as excinfo:
        parse_visible_devices(raw)
    assert str(excinfo.value) == message


def test_each_source_leads_its_messages() -> None:
    """The request records where its devices came from, and a refusal starts with that source."""
    assert request({"NVIDIA_VISIBLE_DEVICES": "0"}).source is RequestSource.VISIBLE_DEVICES
    assert request({"CUDA_VERSION": "12.4"}).source is RequestSource.LEGACY_IMAGE
    mount = MountSpec(destination="/var/run/nvidia-container-devices/gpu0", source="/dev/null", type="bind")
    with pytest.raises(RequestError) as excinfo:
        parse_request(spec({}, mounts=(mount,)), accept_envvar_when_unprivileged=True, accept_volume_mounts=True)
    assert str(excinfo.value).startswith("volume mounts under /var/run/nvidia-container-devices='gpu0': 'gpu0' is not")


def test_entries_trim_blanks_and_drop_empty_ones() -> None:
    """Lists split on commas; ASCII blanks around entries go, empty entries vanish, other spaces stay."""
    assert entries(" a, ,b ,\t\n,") == ("a", "b")
    assert entries("") == ()
    assert entries("\u2003a") == ("\u2003a",)


@pytest.mark.parametrize(
    ("entry", "token"),
    [
        pytest.param("0", ChannelId(0), id="zero"),
        pytest.param("01", ChannelId(1), id="leading-zero"),
        pytest.param("1048575", ChannelId(1048575), id="largest"),
        pytest.param("1048576", Unknown("1048576"), id="too-large"),
        pytest.param("99999999", Unknown("99999999"), id="too-long"),
        pytest.param("all", Keyword.ALL, id="all"),
        pytest.param("none", Unknown("none"), id="none-is-not-a-channel-keyword"),
        pytest.param("-1", Unknown("-1"), id="negative"),
        pytest.param("٣", Unknown("٣"), id="non-ascii-digit"),
    ],
)
def test_channel_tokens(entry: str, token: object) -> None:
    """IMEX channel entries: decimal ids below 2^20, or 'all'."""
    assert channel_token(entry) == token
    assert type(channel_token(entry)) is type(token)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param("", ChannelList(all_channels=False, channels=()), id="empty"),
        pytest.param("3, 0,3", ChannelList(all_channels=False, channels=(3, 0)), id="order-kept-duplicates-dropped"),
        pytest.param("1,,2", ChannelList(all_channels=False, channels=(1, 2)), id="empty-entries-dropped"),
        pytest.param("all", ChannelList(all_channels=True, channels=()), id="all"),
        pytest.param("x,all", ChannelList(all_channels=True, channels=()), id="all-decides"),
    ],
)
def test_decode_channels(raw: str, expected: ChannelList) -> None:
    """A channel list decodes to ids in order, or to 'all' for the front-end to interpret."""
    assert decode_channels(raw, source="NVIDIA_IMEX_CHANNELS") == expected


@pytest.mark.parametrize("source", ["NVIDIA_IMEX_CHANNELS", "--imex-channel"])
@pytest.mark.parametrize(("raw", "entry"), [("-1", "-1"), ("0, 1048576", "1048576"), ("2,none", "none")])
def test_channel_refusals(source: str, raw: str, entry: str) -> None:
    """One message for every front-end, led by that front-end's own name for the value."""
    with pytest.raises(RequestError) as excinfo:
        decode_channels(raw, source=source)
    assert str(excinfo.value) == (
        f"{source}={raw!r}: {entry!r} is not a channel; expected comma-separated decimal ids below 1048576"
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param("", False, id="empty-is-off"),
        pytest.param(" \t", False, id="blank-is-off"),
        pytest.param("all", True, id="all"),
        pytest.param(" all\n", True, id="all-trimmed"),
        pytest.param("0", "NVIDIA_MIG_CONFIG_DEVICES='0': only 'all' is supported", id="list"),
        pytest.param("all,all", "NVIDIA_MIG_CONFIG_DEVICES='all,all': only 'all' is supported", id="repeated"),
        pytest.param("ALL", "NVIDIA_MIG_CONFIG_DEVICES='ALL': only 'all' is supported", id="upper-case"),
    ],
)
def test_mig_control_value(raw: str, expected: bool | str) -> None:
    """MIG control: blank is off, 'all' is on, anything else is refused naming the value."""
    if isinstance(expected, bool):
        assert decode_mig_control(raw, source="NVIDIA_MIG_CONFIG_DEVICES") is expected
        return
    with pytest.raises(RequestError) as excinfo:
        decode_mig_control(raw, source="NVIDIA_MIG_CONFIG_DEVICES")
    assert str(excinfo.value) == expected


@given(st.text(max_size=40))
def test_tokenizers_never_raise(entry: str) -> None:
    """A token for any text: refusal is the decoders' decision, made with the source's name."""
    assert isinstance(device_token(entry), (Keyword, GpuIndex, GpuUuid, MigUuid, MigIndex, GpuCount, CdiName, Unknown))
    assert isinstance(channel_token(entry), (Keyword, ChannelId, Unknown))


@given(st.text(max_size=40))
def test_any_channel_or_mig_string_decodes_or_raises_our_error(raw: str) -> None:
    """Container input never produces another exception."""
    with contextlib.suppress(RequestError):
        decode_channels(raw, source="NVIDIA_IMEX_CHANNELS")
    with contextlib.suppress(RequestError):
        decode_mig_control(raw, source="NVIDIA_MIG_CONFIG_DEVICES")


def test_capabilities() -> None:
    """Default utility,compute; all; none; legacy images get everything."""
    assert parse_capabilities(None) == DEFAULT_CAPABILITIES
    assert parse_capabilities("") == DEFAULT_CAPABILITIES
    assert parse_capabilities(None, legacy=True) == ALL_CAPABILITIES
    assert parse_capabilities("all") == ALL_CAPABILITIES
    assert parse_capabilities("none") == frozenset()
    assert parse_capabilities(" video , utility") == {Capability.VIDEO, Capability.UTILITY}


def test_unknown_capability_is_refused_with_the_list() -> None:
    """The message names the bad capability and lists the valid ones."""
    with pytest.raises(RequestError, match=r"unknown capability 'cuda'.*compat32, compute, display"):
        parse_capabilities("compute,cuda")
    with pytest.raises(RequestError, match=r"unknown capability 'evil'"):
        parse_capabilities("all,display,evil")


def test_unset_means_untouched() -> None:
    """No NVIDIA variables: no request, and the fast path says so too."""
    assert request({"PATH": "/bin"}) is None
    assert not asks_for_gpu(raw({"PATH": "/bin"}))


def test_legacy_image_gets_all_gpus_and_capabilities() -> None:
    """CUDA_VERSION without NVIDIA_REQUIRE_CUDA: all GPUs, all capabilities, cuda>= requirement."""
    req = request({"CUDA_VERSION": "11.0.3"})
    assert req is not None and req.all_devices and req.capabilities == ALL_CAPABILITIES
    assert [str(r) for r in req.requirements] == ["cuda>=11.0"]
    assert request({"CUDA_VERSION": "11.0", "NVIDIA_REQUIRE_CUDA": "cuda>=11.0"}) is None


def test_requirements_collected_and_disabled() -> None:
    """NVIDIA_REQUIRE_* are collected by name; NVIDIA_DISABLE_REQUIRE=true drops them."""
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=12.0", "NVIDIA_REQUIRE_ARCH": "arch>=8.0"}
    req = request(env)
    assert req is not None and [str(r) for r in req.requirements] == ["arch>=8.0", "cuda>=12.0"]
    req = request(env | {"NVIDIA_DISABLE_REQUIRE": "true"})
    assert req is not None and req.requirements == ()


def test_unprivileged_env_request_can_be_refused() -> None:
    """With the NVIDIA policy switch off, only privileged containers may ask by env."""
    env = {"NVIDIA_VISIBLE_DEVICES": "all"}
    assert request(env, accept_envvar_when_unprivileged=False) is None
    assert request(env, accept_envvar_when_unprivileged=False, privileged=True) is not None


def test_volume_mount_list_takes_priority() -> None:
    """Device-plugin /dev/null mounts win over the env when accepted; imex entries are not GPUs."""
    mounts = (
        MountSpec(destination="/var/run/nvidia-container-devices/" + UUID, source="/dev/null", type="bind"),
        MountSpec(destination="/var/run/nvidia-container-devices/imex/3", source="/dev/null", type="bind"),
        MountSpec(destination="/var/run/nvidia-container-devices/1", source="/etc/passwd", type="bind"),
    )
    bundle = spec({"NVIDIA_VISIBLE_DEVICES": "all"}, mounts=mounts)
    req = parse_request(bundle, accept_envvar_when_unprivileged=False, accept_volume_mounts=True)
    assert req is not None and req.devices == (GpuUuid(UUID),) and not req.all_devices
    assert asks_for_gpu(raw({}, mounts=mounts))
    # Not accepted: the mounts are ignored and the (allowed) env decides.
    req = parse_request(bundle, accept_envvar_when_unprivileged=True, accept_volume_mounts=False)
    assert req is not None and req.all_devices


@given(st.text(max_size=60))
def test_any_device_string_parses_or_raises_our_error(raw: str) -> None:
    """Container input never produces another exception."""
    with contextlib.suppress(RequestError):
        parse_visible_devices(raw)


@given(st.text(max_size=60))
def test_any_capability_string_parses_or_raises_our_error(raw: str) -> None:
    """Container input never produces another exception."""
    with contextlib.suppress(RequestError):
        assert parse_capabilities(raw) <= ALL_CAPABILITIES


_ENV_KEYS = st.sampled_from(["NVIDIA_VISIBLE_DEVICES", "CUDA_VERSION", "NVIDIA_REQUIRE_CUDA",
                             "NVIDIA_DRIVER_CAPABILITIES",
                             "PATH"])
_ENV_VALUES = st.sampled_from(["", " ", "all", "none", "void", "0", "11.0", "cuda>=11.0", "compute"])
_MOUNTS = st.lists(st.builds(MountSpec, destination=st.sampled_from(
    ["/var/run/nvidia-container-devices/0", "/var/run/nvidia-container-devices/all", "/data", "/var/run/x"]),
    source=st.sampled_from(["/dev/null", "/src"]), type=st.just("bind")), max_size=2)


@given(st.dictionaries(_ENV_KEYS, _ENV_VALUES, max_size=4), _MOUNTS, st.booleans(), st.booleans())
def test_fast_path_never_skips_a_request(env: dict[str, str], mounts: list[MountSpec], unpriv: bool,
                                         volumes: bool) -> None:
    """Whenever the full parser would inject something, the fast path sends the container to it."""
    try:
        req = parse_request(spec(env, mounts=tuple(mounts)), accept_envvar_when_unprivileged=unpriv,
                            accept_volume_mounts=volumes)
    except RequestError:
        req = "refused"  # type: ignore[assignment]
    if req is not None:
        assert asks_for_gpu(raw(env, tuple(mounts)))


def test_imex_channels_and_gated_variables() -> None:
    """NVIDIA_IMEX_CHANNELS (decimal, 'all' ignored) and exactly-'enabled' gated variables."""
    req = request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "3, 0,3", "NVIDIA_GDS": "enabled",
                   "NVIDIA_MOFED": "true"})
    assert req is not None and req.imex_channels == (3, 0) and req.gated == {"gds"}
    req = request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "all"})
    assert req is not None and req.imex_channels == ()
    with pytest.raises(RequestError, match="'-1' is not a channel"):
        request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "-1"})
    with pytest.raises(RequestError, match="below 1048576"):
        request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "1048576"})
    unprivileged = request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "1"},
                           accept_envvar_when_unprivileged=False, privileged=True)
    assert unprivileged is not None and unprivileged.imex_channels == (1,)


def test_mig_control_variables_need_privilege() -> None:
    """NVIDIA_MIG_CONFIG_DEVICES: refused unprivileged (NVIDIA's rule), only 'all' accepted."""
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_MIG_CONFIG_DEVICES": "all"}
    with pytest.raises(RequestError, match="unprivileged container"):
        request(env)
    req = request(env, privileged=True)
    assert req is not None and req.mig_config and not req.mig_monitor
    with pytest.raises(RequestError, match="only 'all'"):
        request({**env, "NVIDIA_MIG_CONFIG_DEVICES": "0"}, privileged=True)


def test_cdi_annotations_take_priority_when_accepted() -> None:
    """cdi.k8s.io/* annotations naming nvidia.com/gpu=... decide the devices; other vendors are ignored."""
    bundle = BundleSpec(env={"NVIDIA_VISIBLE_DEVICES": "all"}, rootfs=Path("/r"), privileged=False, annotations=(
        ("cdi.k8s.io/gpu-plugin", "nvidia.com/gpu=1, nvidia.com/gpu=" + UUID),
        ("cdi.k8s.io/other", "vendor.com/fpga=0"),
        ("io.kubernetes.pod.name", "nvidia.com/gpu=3"),
    ))
    req = parse_request(bundle, accept_envvar_when_unprivileged=True, accept_volume_mounts=False,
                        accept_cdi_annotations=True)
    assert req is not None and req.devices == (GpuIndex(1), GpuUuid(UUID))
    assert req.source is RequestSource.CDI_ANNOTATIONS
    assert asks_for_gpu({"process": {"env": []}, "annotations": dict(bundle.annotations)})
    ignored = parse_request(bundle, accept_envvar_when_unprivileged=True, accept_volume_mounts=False)
    assert ignored is not None and ignored.all_devices  # not accepted: the env decides


# --- count=N and any (issue 15): which GPUs is decided at the start, under the sharing policy ---------


@pytest.mark.parametrize(
    ("entry", "token"),
    [
        pytest.param("count=3", GpuCount(3), id="count"),
        pytest.param("count=9999", GpuCount(9999), id="count-largest"),
        pytest.param("any", Keyword.ANY, id="any"),
        pytest.param("count=0", Unknown("count=0"), id="count-zero-is-not-a-count"),
        pytest.param("count=01", Unknown("count=01"), id="count-leading-zero"),
        pytest.param("count=٣", Unknown("count=٣"), id="count-non-ascii-digit"),
        pytest.param("ANY", Unknown("ANY"), id="any-is-lower-case"),
    ],
)
def test_count_and_any_tokens(entry: str, token: object) -> None:
    """count=N (N from 1, ASCII digits) and any are tokens of their own; other spellings are not counts."""
    assert device_token(entry) == token
    assert type(device_token(entry)) is type(token)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param("count=3", DeviceList(all_devices=False, devices=(), count=3), id="count"),
        pytest.param(" count=2 ,", DeviceList(all_devices=False, devices=(), count=2), id="count-trimmed"),
        pytest.param("any", DeviceList(all_devices=False, devices=(), count=1), id="any-is-count-1"),
        pytest.param("all,any", listed(all_devices=True), id="all-decides-before-any"),
        pytest.param("count=2,all", listed(all_devices=True), id="all-decides-before-count"),
        pytest.param("none,count=2", listed(), id="none-decides-before-count"),
        pytest.param("any,void", None, id="void-anywhere-wins"),
    ],
)
def test_count_and_any_decode(raw: str, expected: DeviceList | None) -> None:
    """any = count=1; NVIDIA's keywords still decide the whole list first."""
    assert parse_visible_devices(raw) == expected


@pytest.mark.parametrize("raw", ["count=2,0", "0,count=2", "any,1", "GPU-1a2b3c4d-0000-1111-2222-333344445555,any",
                                 "any,any", "count=1,count=2", "any,count=2"])
def test_count_and_any_must_stand_alone(raw: str) -> None:
    """A count with anything else (ids or another count) is refused: it stands for the whole list."""
    with pytest.raises(RequestError) as excinfo:
        parse_visible_devices(raw)
    assert str(excinfo.value) == (f"NVIDIA_VISIBLE_DEVICES={raw!r}: 'any' and 'count=N' stand for the whole list; "
                                  "expected one of them alone, or a list of GPU indices or UUIDs")


@pytest.mark.parametrize("raw", ["count=0", "count=10000", "count=01", "count=", "count=-1", "count=x"])
def test_a_count_outside_1_to_9999_is_refused_naming_it(raw: str) -> None:
    """count=0 (and other counts that are no count) is refused, naming the value."""
    with pytest.raises(RequestError, match=f"NVIDIA_VISIBLE_DEVICES={raw!r}: {raw!r} "):
        parse_visible_devices(raw)


@pytest.mark.parametrize("raw", ["count=0", "count=10000"])
def test_a_bad_count_is_not_called_a_cdi_name(raw: str) -> None:
    """The refusal of a count that is out of range says what a count may be, not that it is a CDI device name
    (the '=' rule that makes CDI names must not swallow a count=N typed wrong)."""
    with pytest.raises(RequestError) as excinfo:
        parse_visible_devices(raw)
    assert "CDI" not in str(excinfo.value)
    assert "count=N" in str(excinfo.value)


def test_count_reaches_the_request_with_no_devices() -> None:
    """NVIDIA_VISIBLE_DEVICES=count=2 / any: a GpuRequest with count set, no devices, not all; raw kept for messages."""
    req = request({"NVIDIA_VISIBLE_DEVICES": "count=2", "NVIDIA_DRIVER_CAPABILITIES": "compute"})
    assert req is not None
    assert (req.count, req.devices, req.all_devices) == (2, (), False)
    assert req.capabilities == {Capability.COMPUTE}
    assert (req.source, req.raw) == (RequestSource.VISIBLE_DEVICES, "count=2")
    assert asks_for_gpu(raw({"NVIDIA_VISIBLE_DEVICES": "count=2"}))
    req = request({"NVIDIA_VISIBLE_DEVICES": "any"})
    assert req is not None and (req.count, req.devices, req.all_devices) == (1, (), False)
    listed_request = request({"NVIDIA_VISIBLE_DEVICES": "0,1"})
    assert listed_request is not None and listed_request.count is None



@pytest.mark.parametrize(("raw", "devices", "asks"), [
    ("0,mig=3g.20gb#instance1", (), (MigAsk(profile="3g.20gb", name="instance1", gpu=GpuIndex(0)),)),
    ("mig=1g.5gb", (), (MigAsk(profile="1g.5gb"),)),
    ("0,1,mig=1g.5gb+me", (GpuIndex(0),), (MigAsk(profile="1g.5gb+me", gpu=GpuIndex(1)),)),
    # a run of asks after one GPU token is all on that GPU; a later GPU token is a GPU again
    ("0,mig=1g.5gb,mig=2g.10gb#b,1", (GpuIndex(1),),
     (MigAsk(profile="1g.5gb", gpu=GpuIndex(0)), MigAsk(profile="2g.10gb", name="b", gpu=GpuIndex(0)))),
    ("0:1,mig=1g.10gb", (MigIndex(0, 1),), (MigAsk(profile="1g.10gb"),)),  # a MIG index is no GPU to apply to
])
def test_mig_asks_apply_to_the_gpu_token_before_them(raw: str, devices: tuple[object, ...],
                                                     asks: tuple[MigAsk, ...]) -> None:
    """`mig=PROFILE[#NAME]` applies to the GPU token right before it (that GPU is then not given whole)."""
    decoded = decode_devices(raw, source="NVIDIA_VISIBLE_DEVICES")
    assert decoded is not None
    assert (decoded.devices, decoded.mig_asks) == (devices, asks)


@pytest.mark.parametrize(("raw", "message"), [
    ("0,mig=3g", "'mig=3g' is not a MIG instance request"),
    ("0,mig=3g.20gb#", "is not a MIG instance request"),
    ("0,mig=3g.20gb#a/b", "is not a MIG instance request"),
    ("0,mig=3g.20gb#x,mig=1g.5gb#x", "one instance name is asked twice"),
    ("count=2,mig=1g.5gb", "stand for the whole list"),
])
def test_malformed_mig_asks_are_refused_for_what_they_are(raw: str, message: str) -> None:
    """A mig= entry outside the grammar is refused as a MIG request (never called a CDI name)."""
    with pytest.raises(RequestError, match=re.escape(message)) as refused:
        decode_devices(raw, source="NVIDIA_VISIBLE_DEVICES")
    assert "CDI" not in str(refused.value)


@pytest.mark.parametrize(("raw", "message"), [
    pytest.param("0," + ",".join(["mig=1g.5gb"] * 60_000), "has 60001 comma-separated entries, empty ones counted "
                 "('0', ...); the limit is 256: list each GPU or MIG device once", id="60000-mig-asks"),
    pytest.param(",".join(["0"] * 257), "has 257 comma-separated entries", id="one-too-many"),
    pytest.param("0," * 300, "has 301 comma-separated entries, empty ones counted", id="empty-entries"),
    pytest.param("0,mig=1g.5gb#" + "n" * 200, f"the entry 'mig=1g.5gb#{'n' * 29}'... is 211 "
                 "characters long, blanks counted; the limit is 128: expected 'all'", id="long-name"),
    pytest.param(" " * 200 + "0", "is 201 characters long, blanks counted", id="long-blanks"),
])
def test_a_device_list_past_its_bounds_is_refused_naming_the_limit(raw: str, message: str) -> None:
    """Issue 31: a device list is bounded (256 entries of 128 characters) before any entry is decoded; the
    refusal names the limit and quotes the start of the value, never all of it."""
    with pytest.raises(RequestError, match=re.escape(message)) as refused:
        request({"NVIDIA_VISIBLE_DEVICES": raw})
    assert len(str(refused.value)) < 1000


def test_a_device_list_at_its_bounds_is_accepted() -> None:
    """256 entries, and an entry of 128 characters (a 63-character #NAME is far below it), decode."""
    at_bounds = parse_visible_devices(",".join(str(n) for n in range(256)))
    assert at_bounds is not None and len(at_bounds.devices) == 256
    name = "n" * 63
    longest = parse_visible_devices(f"0,{' ' * (128 - len('mig=1g.10gb+me#') - 63)}mig=1g.10gb+me#{name}")
    assert longest is not None and longest.mig_asks == (MigAsk(profile="1g.10gb+me", name=name, gpu=GpuIndex(0)),)
