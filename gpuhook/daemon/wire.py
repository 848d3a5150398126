"""The bytes between the hook and gpuhookd: one request, one reply, on a unix stream socket.

Request: ``gpuhookd/1 KIND N1 N2 ...\\n`` then the parts, N1 bytes, N2 bytes, ... back to back.
Reply: ``gpuhookd/1 VERDICT STATUS N\\n`` then N bytes of message for the hook's stderr.

Kinds: ``hook`` (parts: version, config, debug, env, state, spec) from the Python hook, which has
read config.json and found a GPU request; ``relay`` (parts: version, argv, env, state) from
gpuhook-relay (relay/gpuhook-relay.c), for every call it does not answer itself (relay/answers.h);
``ping`` (parts: version); and ``no-gpu`` (parts: the container's id), the relay's notice of a start
it answered itself as asking for no GPU, which gets no reply. ``hook`` and ``relay`` carry five fds
(see ``client.NAMESPACES``). Verdicts: ``done`` (the request ran; STATUS is the hook's exit status),
``declined`` (the daemon cannot serve it: the hook does the work itself; the message says why) and ``pong``.

Everything here is plain bytes and ints, importing nothing: the hook's side of it runs on
every GPU container start. The fd lists (SCM_RIGHTS) and peer credentials (SO_PEERCRED) that
go with the messages are packed by ``gpuhook.sys.fdpass``.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

MAGIC = b"gpuhookd/1"
DEFAULT_SOCKET = "/run/gpuhook/gpuhookd.sock"
HEADER_LIMIT = 256
#: state + config.json at their limits (strictjson), plus the environment and small fields
REQUEST_LIMIT = (1 << 20) + (8 << 20) + (1 << 20)
REPLY_LIMIT = 1 << 16
HOOK_PARTS = ("version", "config", "debug", "env", "state", "spec")
RELAY_PARTS = ("version", "argv", "env", "state")
NO_GPU = b"no-gpu"
KINDS = {b"hook": len(HOOK_PARTS), b"relay": len(RELAY_PARTS), b"ping": 1, NO_GPU: 1}
#: The kinds that carry the caller's view (its namespaces and root: five fds); the others ask only for root.
WITH_VIEW = (b"hook", b"relay")
VERDICTS = (b"done", b"declined", b"pong")



class WireError(ValueError):
    """Bytes that are not a well-formed message."""


def encode_request(kind: bytes, parts: Sequence[bytes]) -> bytes:
    """A request of *kind* carrying *parts*."""
    sizes = b" ".join(b"%d" % len(part) for part in parts)
    return b"%s %s %s\n" % (MAGIC, kind, sizes) + b"".join(parts)


def hook_parts(version: str, config: str | None, debug: bool, env: Mapping[str, str], state: bytes,
               spec: bytes) -> list[bytes]:
    """The parts of a ``hook`` request (config None: the default lookup; an empty part)."""
    env_bytes = b"\0".join(f"{key}={value}".encode("utf-8", "surrogateescape") for key, value in env.items())
    config_bytes = b"" if config is None else b"=" + config.encode("utf-8", "surrogateescape")
    return [version.encode(), config_bytes, b"1" if debug else b"0", env_bytes, state, spec]


def parse_header(line: bytes) -> tuple[bytes, list[int]]:
    """(kind, part sizes) of a request header line (without its newline); raises WireError."""
    words = line.split(b" ")
    if len(words) < 2 or words[0] != MAGIC or words[1] not in KINDS:
        raise WireError(f"not a gpuhookd/1 request: {line[:64]!r}")
    if len(words) - 2 != KINDS[words[1]] or not all(w.isdigit() and len(w) <= 9 for w in words[2:]):
        raise WireError(f"malformed {words[1].decode()} request header: {line[:64]!r}")
    sizes = [int(w) for w in words[2:]]
    if sum(sizes) > REQUEST_LIMIT:
        raise WireError(f"request of {sum(sizes)} bytes; the limit is {REQUEST_LIMIT}")
    return words[1], sizes


def split_parts(body: bytes, sizes: Sequence[int]) -> list[bytes]:
    """Cut *body* into parts of *sizes*."""
    parts, offset = [], 0
    for size in sizes:
        parts.append(body[offset : offset + size])
        offset += size
    return parts


def decode_hook_parts(parts: Sequence[bytes]) -> tuple[str, str | None, bool, dict[str, str], bytes, bytes]:
    """(version, config, debug, env, state, spec) of a ``hook`` request; raises WireError."""
    version, config, debug, env, state, spec = parts
    if config and not config.startswith(b"="):
        raise WireError("malformed config part")
    return (version.decode("ascii", "replace"), config[1:].decode("utf-8", "surrogateescape") if config else None,
            debug == b"1", _decode_env(env), state, spec)


def decode_relay_parts(parts: Sequence[bytes]) -> tuple[str, list[str], dict[str, str], bytes]:
    """(version, argv, env, state) of a ``relay`` request; raises WireError."""
    version, argv, env, state = parts
    words = argv.decode("utf-8", "surrogateescape").split("\0")
    return version.decode("ascii", "replace"), words, _decode_env(env), state


def _decode_env(env: bytes) -> dict[str, str]:
    """``KEY=VALUE`` entries joined by NULs (an environ block) as a dict."""
    pairs = {}
    for entry in env.split(b"\0") if env else ():
        key, sep, value = entry.decode("utf-8", "surrogateescape").partition("=")
        if not sep or not key:
            raise WireError(f"environment entry without KEY=: {entry[:64]!r}")
        pairs[key] = value
    return pairs


def encode_reply(verdict: bytes, status: int, message: str) -> bytes:
    """A reply; the message is cut to the reply limit."""
    data = message.encode("utf-8", "replace")[: REPLY_LIMIT - HEADER_LIMIT]
    return b"%s %s %d %d\n" % (MAGIC, verdict, status, len(data)) + data


def decode_reply(data: bytes) -> tuple[bytes, int, str]:
    """(verdict, status, message) of a complete reply; raises WireError."""
    line, newline, message = data.partition(b"\n")
    words = line.split(b" ")
    if (not newline or len(words) != 4 or words[0] != MAGIC or words[1] not in VERDICTS
            or not words[2].lstrip(b"-").isdigit() or not words[3].isdigit() or int(words[3]) != len(message)):
        raise WireError(f"not a complete gpuhookd/1 reply: {data[:64]!r}")
    return words[1], int(words[2]), message.decode("utf-8", "replace")

