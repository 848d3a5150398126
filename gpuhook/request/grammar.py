"""The request grammar, in one place: device lists, IMEX channel lists and the MIG control value.

Every front-end (NVIDIA_* variables, device-plugin mounts, CDI annotations,
``nvidia-container-cli`` argv) hands its raw text here together with the name
of where it came from, so the accepted language and the refusals are the same
everywhere while each message still names its own source
(``NVIDIA_IMEX_CHANNELS='x'`` vs ``--imex-channel='x'``).

Decoding has two steps. ``entries`` splits a comma-separated list (blanks
trimmed, empty entries dropped) and a tokenizer (``device_token``,
``channel_token``) turns each entry into a typed token without ever raising:
an entry outside the grammar is a token too (``Unknown``, ``CdiName``). The
decoders then apply NVIDIA's list semantics, in which a keyword decides the
whole list (so the other entries are not judged), and refuse the first token
left that is not an id, naming it. A new kind of token (``count=N``, ``any``,
``mig=PROFILE#NAME``) is a new dataclass, a row of ``_DEVICE_FORMS`` (tried
before the ``=`` rule that makes CDI names) and a case in the decoder.

Digits are ASCII only, because Python's ``int()`` also accepts "٣", "1_0" and
" +3 " (security.md §3.4).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, NoReturn

from gpuhook.errors import RequestError
from gpuhook.request.model import DeviceId, GpuIndex, GpuUuid, MigAsk, MigIndex, MigUuid
from gpuhook.request.quick import BLANKS

_UUID: Final = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_INDEX_RE: Final = re.compile(r"[0-9]{1,4}")
_GPU_UUID_RE: Final = re.compile(rf"GPU-{_UUID}")
_MIG_UUID_RE: Final = re.compile(rf"MIG-{_UUID}|MIG-GPU-{_UUID}/[0-9]{{1,4}}/[0-9]{{1,4}}")
_MIG_INDEX_RE: Final = re.compile(r"([0-9]{1,4}):([0-9]{1,4})")
_CHANNEL_RE: Final = re.compile(r"[0-9]{1,7}")
_COUNT_RE: Final = re.compile(r"count=([1-9][0-9]{0,3})")
#: a GPU-instance profile as ``nvidia-smi mig -lgip`` names it: 1g.5gb, 3g.20gb, 1g.10gb+me, 7g.80gb
MIG_PROFILE: Final = r"[1-8]g\.[1-9][0-9]{0,3}gb(?:\+me\.all|\+me|\+gfx|-me)*"
#: ``mig=3g.20gb``, ``mig=1g.5gb+me#instance1``: a profile, then an optional instance name
_MIG_ASK_RE: Final = re.compile(rf"mig=({MIG_PROFILE})(?:#([A-Za-z0-9][A-Za-z0-9_.-]{{0,62}}))?")

#: The most entries a device list may have, and the longest entry: a host has some tens of GPUs at most, seven MIG
#: devices on each, and the longest entry (``MIG-GPU-<uuid>/G/C``, ``mig=PROFILE#NAME``) is under 100 characters.
#: Checked before an entry is decoded (so before any lock is taken): with them, what a start spends on its
#: request is bounded, as NVIDIA_REQUIRE_* is (60,000 mig= entries once held the ledger's lock for 27 s).
MAX_DEVICE_ENTRIES: Final = 256
MAX_ENTRY_LENGTH: Final = 128

#: IMEX channel ids are below 2^20 (the driver's NVIDIA_IMEX_CHANNEL_MAX).
MAX_IMEX_CHANNEL: Final = 1 << 20

ACCEPTED_FORMS: Final = (
    "'all', 'none', 'void', 'any', 'count=N' (N free GPUs), or a comma-separated list of GPU indices (0,1), "
    "GPU UUIDs (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx), MIG UUIDs (MIG-…), MIG indices (0:1) or MIG instances "
    "to make (0,mig=3g.20gb#NAME)"
)


class Keyword(enum.StrEnum):
    """A word that stands for a whole list rather than one entry of it."""

    ALL = "all"
    NONE = "none"
    VOID = "void"
    #: one free GPU: ``count=1``
    ANY = "any"


@dataclass(frozen=True, slots=True)
class ChannelId:
    """An IMEX channel by number (``/dev/nvidia-caps-imex-channels/channelN``)."""

    channel: int

    def __str__(self) -> str:
        return str(self.channel)


@dataclass(frozen=True, slots=True)
class GpuCount:
    """``count=N``: N GPUs that are free under their sharing policies, picked at the start."""

    count: int

    def __str__(self) -> str:
        return f"count={self.count}"


@dataclass(frozen=True, slots=True)
class CdiName:
    """A CDI device name (``nvidia.com/gpu=0``, ``cdi/…``): refused, the hook takes indices and UUIDs."""

    text: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, slots=True)
class Unknown:
    """An entry outside the grammar, kept as written so that the refusal can name it."""

    text: str

    def __str__(self) -> str:
        return self.text


DeviceToken = Keyword | DeviceId | GpuCount | MigAsk | CdiName | Unknown
ChannelToken = Keyword | ChannelId | Unknown

_DEVICE_KEYWORDS: Final = {k.value: k for k in Keyword}
#: The device ids, each a whole-entry pattern and the token it makes, tried in order.
_DEVICE_FORMS: Final[tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], DeviceToken]], ...]] = (
    (_INDEX_RE, lambda m: GpuIndex(int(m[0]))),
    (_GPU_UUID_RE, lambda m: GpuUuid(m[0])),
    (_MIG_UUID_RE, lambda m: MigUuid(m[0])),
    (_MIG_INDEX_RE, lambda m: MigIndex(int(m[1]), int(m[2]))),
    (_COUNT_RE, lambda m: GpuCount(int(m[1]))),
    (_MIG_ASK_RE, lambda m: MigAsk(profile=m[1], name=m[2])),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceList:
    """A decoded device list: every GPU (``all``), ``count`` free GPUs, or exactly ``devices`` (none for ``none``)."""

    all_devices: bool
    devices: tuple[DeviceId, ...]
    count: int | None = None
    #: ``mig=PROFILE[#NAME]`` entries, each with the GPU token right before it (that GPU is then not in devices)
    mig_asks: tuple[MigAsk, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ChannelList:
    """A decoded IMEX channel list: ``all`` was listed, or exactly ``channels`` (deduplicated, in order)."""

    all_channels: bool
    channels: tuple[int, ...]


def entries(raw: str) -> tuple[str, ...]:
    """The entries of a comma-separated list, blanks trimmed, empty ones dropped."""
    return _trimmed(raw.split(","))


def _trimmed(parts: list[str]) -> tuple[str, ...]:
    return tuple(entry for entry in (part.strip(BLANKS) for part in parts) if entry)


def _bounded_entries(raw: str, *, source: str) -> tuple[str, ...]:
    """``entries`` of a device list, refused (RequestError naming the limit) past MAX_DEVICE_ENTRIES entries or
    with one longer than MAX_ENTRY_LENGTH; the value is not quoted whole, since it is what is too large."""
    parts = raw.split(",", MAX_DEVICE_ENTRIES)  # one part more than allowed says "too many", whatever follows
    if len(parts) > MAX_DEVICE_ENTRIES:
        raise RequestError(f"{source} has {raw.count(',') + 1} comma-separated entries, empty ones counted "
                           f"({parts[0].strip(BLANKS)[:40]!r}, ...); the limit is {MAX_DEVICE_ENTRIES}: list each GPU "
                           "or MIG device once, or ask for 'all' or 'count=N'")
    longest = max(parts, key=len)
    if len(longest) > MAX_ENTRY_LENGTH:
        raise RequestError(f"{source}: the entry {longest.strip(BLANKS)[:40]!r}... is {len(longest)} characters "
                           f"long, blanks counted; the limit is {MAX_ENTRY_LENGTH}: expected {ACCEPTED_FORMS}")
    return _trimmed(parts)


def device_token(entry: str) -> DeviceToken:
    """One trimmed entry of a device list as a token; never raises (refusals are tokens too)."""
    if entry in _DEVICE_KEYWORDS:
        return _DEVICE_KEYWORDS[entry]
    for pattern, make in _DEVICE_FORMS:
        if match := pattern.fullmatch(entry):
            return make(match)
    if entry.startswith(("count=", "mig=")):
        return Unknown(entry)  # refused as a count or a MIG profile, not as a CDI name
    return CdiName(entry) if entry.startswith("cdi/") or "=" in entry else Unknown(entry)


def decode_devices(raw: str, *, source: str) -> DeviceList | None:
    """A device list with NVIDIA's semantics, or None for void (unset-equivalent).

    At most MAX_DEVICE_ENTRIES entries of MAX_ENTRY_LENGTH characters (RequestError past them). Empty or
    ``void`` anywhere is None; otherwise the first of ``all``/``none``
    decides; otherwise ``any`` or ``count=N`` must stand alone (gpuhook's: which GPUs is
    decided at the start, under the sharing policy); otherwise every entry must be a device id
    (duplicates dropped) or a ``mig=PROFILE[#NAME]`` ask.
    """
    tokens = [device_token(entry) for entry in _bounded_entries(raw, source=source)]
    if not tokens or Keyword.VOID in tokens:
        return None
    for token in tokens:
        if token is Keyword.ALL or token is Keyword.NONE:
            # NVIDIA: the first of all/none encountered decides, whatever else is listed.
            return DeviceList(all_devices=token is Keyword.ALL, devices=())
    counts = [1 if token is Keyword.ANY else token.count for token in tokens
              if token is Keyword.ANY or isinstance(token, GpuCount)]
    if counts:
        if len(tokens) > 1:
            raise RequestError(f"{source}={raw!r}: 'any' and 'count=N' stand for the whole list; expected one of them "
                               "alone, or a list of GPU indices or UUIDs")
        return DeviceList(all_devices=False, devices=(), count=counts[0])
    return _device_ids(tokens, raw, source)


def _device_ids(tokens: list[DeviceToken], raw: str, source: str) -> DeviceList:
    """A list of device ids and ``mig=`` asks; each ask applies to the GPU token right before its run."""
    ids: list[DeviceId] = []
    asks: list[MigAsk] = []
    on: GpuIndex | GpuUuid | None = None  # the GPU the current run of mig= entries applies to
    previous: DeviceToken | None = None
    for token in tokens:
        match token:
            case MigAsk():
                if isinstance(previous, GpuIndex | GpuUuid):
                    on = previous
                    ids.pop()  # that GPU gets the instance, not itself whole
                elif not isinstance(previous, MigAsk):
                    on = None
                asks.append(MigAsk(profile=token.profile, name=token.name, gpu=on))
            case GpuIndex() | GpuUuid() | MigUuid() | MigIndex():
                ids.append(token)
            case _:
                _refuse(token, raw, source)
        previous = token
    names = [(ask.gpu, ask.name) for ask in asks if ask.name]
    if len(names) != len(set(names)):
        raise RequestError(f"{source}={raw!r}: one instance name is asked twice on one GPU; expected each "
                           "#NAME once (a name stands for one instance)")
    return DeviceList(all_devices=False, devices=tuple(dict.fromkeys(ids)), mig_asks=tuple(asks))


def _refuse(token: DeviceToken, raw: str, source: str) -> NoReturn:
    """Raise the RequestError for an entry that is no device id, naming it and what was expected."""
    match token:
        case CdiName():
            raise RequestError(
                f"{source}={raw!r}: {token.text!r} is a CDI device name; gpuhook's hook takes indices or UUIDs. "
                "Fix: request the GPU by index or UUID, or let a CDI-aware engine apply the CDI spec"
            )
        case Unknown(text) if text.startswith("count="):
            raise RequestError(f"{source}={raw!r}: {text!r} is not a count; expected count=N with N a whole "
                               "number from 1 to 9999 (the number of free GPUs wanted)")
        case Unknown(text) if text.startswith("mig="):
            raise RequestError(f"{source}={raw!r}: {text!r} is not a MIG instance request; expected "
                               "mig=PROFILE or mig=PROFILE#NAME with PROFILE a GPU-instance profile as `nvidia-smi "
                               "mig -lgip` lists it (3g.20gb, 1g.5gb+me) and NAME letters, digits, '.', '_' or "
                               "'-' (mig=3g.20gb#instance1)")
    raise RequestError(f"{source}={raw!r}: {str(token)!r} is not a device; expected {ACCEPTED_FORMS}")


def channel_token(entry: str) -> ChannelToken:
    """One trimmed entry of an IMEX channel list as a token; never raises."""
    if entry == Keyword.ALL:
        return Keyword.ALL
    if _CHANNEL_RE.fullmatch(entry) and int(entry) < MAX_IMEX_CHANNEL:
        return ChannelId(int(entry))
    return Unknown(entry)


def decode_channels(raw: str, *, source: str) -> ChannelList:
    """An IMEX channel list: decimal ids below 2^20 (duplicates dropped), or ``all``, which decides the list.

    What ``all`` means is the front-end's call: the hook ignores it, as NVIDIA does; argv refuses it.
    """
    tokens = [channel_token(entry) for entry in entries(raw)]
    if Keyword.ALL in tokens:
        return ChannelList(all_channels=True, channels=())
    channels: list[int] = []
    for token in tokens:
        if not isinstance(token, ChannelId):
            raise RequestError(
                f"{source}={raw!r}: {str(token)!r} is not a channel; expected comma-separated decimal ids "
                f"below {MAX_IMEX_CHANNEL}"
            )
        channels.append(token.channel)
    return ChannelList(all_channels=False, channels=tuple(dict.fromkeys(channels)))


def decode_mig_control(raw: str, *, source: str) -> bool:
    """A MIG control value (NVIDIA_MIG_CONFIG_DEVICES, --mig-config, ...): blank is off, ``all`` is on."""
    value = raw.strip(BLANKS)
    if not value:
        return False
    if value != Keyword.ALL:
        raise RequestError(f"{source}={value!r}: only 'all' is supported")
    return True
