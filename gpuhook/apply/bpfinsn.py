"""eBPF instruction encoding for cgroup v2 device programs (pure; no syscalls).

A device program runs for every open/mknod of a device node in the cgroup and
returns 1 (allow) or 0 (deny); with several programs attached every one must
allow. gpuhook extends the runtime's own program: a block in front of it
allows exactly the GPU devices (``c MAJOR:MINOR`` with read and/or write only,
never mknod, never wildcards) and otherwise falls through to the runtime's
unchanged instructions, which only ever start from ``r1`` (the context) because
the verifier rejects reads of uninitialised registers.

Context (``struct bpf_cgroup_dev_ctx``): ``u32 access_type`` = access << 16 |
type at offset 0, ``u32 major`` at 4, ``u32 minor`` at 8. Instructions are
8 bytes, little-endian on the architectures we run on: opcode u8, dst (low
nibble) and src (high nibble) registers u8, offset s16, immediate s32.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

_INSN: Final = struct.Struct("<BBhi")
INSN_SIZE: Final = _INSN.size

# Opcodes (include/uapi/linux/bpf.h, bpf_common.h).
LDX_MEM_W: Final = 0x61  # BPF_LDX | BPF_MEM | BPF_W
ALU32_AND_K: Final = 0x54
ALU32_RSH_K: Final = 0x74
ALU32_MOV_X: Final = 0xBC
JMP_JNE_K: Final = 0x55
MOV64_K: Final = 0xB7
EXIT: Final = 0x95
CALL: Final = 0x85
LD_IMM64: Final = 0x18

DEV_CHAR: Final = 2  # BPF_DEVCG_DEV_CHAR
ACC_MKNOD, ACC_READ, ACC_WRITE = 1, 2, 4
_ACCESS_BITS: Final = {"r": ACC_READ, "w": ACC_WRITE}


@dataclass(frozen=True, slots=True)
class Insn:
    """One eBPF instruction."""

    code: int
    dst: int = 0
    src: int = 0
    off: int = 0
    imm: int = 0

    def encode(self) -> bytes:
        """The 8 wire bytes."""
        return _INSN.pack(self.code, (self.src << 4) | self.dst, self.off, self.imm)


def decode(data: bytes) -> tuple[Insn, ...]:
    """Instructions from their wire bytes."""
    if len(data) % INSN_SIZE:
        raise ValueError(f"{len(data)} bytes is not a whole number of eBPF instructions")
    out = []
    for i in range(0, len(data), INSN_SIZE):
        code, regs, off, imm = _INSN.unpack_from(data, i)
        out.append(Insn(code, regs & 0x0F, regs >> 4, off, imm))
    return tuple(out)


def encode(insns: Iterable[Insn]) -> bytes:
    """Wire bytes of a program."""
    return b"".join(i.encode() for i in insns)


def allow_block(devices: Sequence[tuple[int, int, str]]) -> tuple[Insn, ...]:
    """Instructions allowing exactly *devices* ((major, minor, access)), falling through otherwise.

    Layout (7 instructions per device: 64 GPUs and the control nodes cost ~500)::

        r2 = ctx->access_type & 0xffff          ; device type
        r3 = ctx->major ; r4 = ctx->minor
        r5 = ctx->access_type >> 16              ; requested access bits
        if r2 != CHAR goto end
        per device:
            if r3 != MAJOR goto next ; if r4 != MINOR goto next
            w0 = w5 & ~granted ; if w0 != 0 goto next     ; asked for more, e.g. mknod
            r0 = 1 ; exit
        end: the runtime's program, unchanged
    """
    head = (
        Insn(LDX_MEM_W, dst=2, src=1, off=0),
        Insn(ALU32_AND_K, dst=2, imm=0xFFFF),
        Insn(LDX_MEM_W, dst=3, src=1, off=4),
        Insn(LDX_MEM_W, dst=4, src=1, off=8),
        Insn(LDX_MEM_W, dst=5, src=1, off=0),
        Insn(ALU32_RSH_K, dst=5, imm=16),
    )
    body: list[Insn] = []
    for major, minor, access in devices:
        body += [
            Insn(JMP_JNE_K, dst=3, off=6, imm=major),
            Insn(JMP_JNE_K, dst=4, off=5, imm=minor),
            Insn(ALU32_MOV_X, dst=0, src=5),
            Insn(ALU32_AND_K, dst=0, imm=~_access_mask(access) & 0xFFFF),
            Insn(JMP_JNE_K, dst=0, off=2, imm=0),
            Insn(MOV64_K, dst=0, imm=1),
            Insn(EXIT),
        ]
    return (*head, Insn(JMP_JNE_K, dst=2, off=len(body), imm=DEV_CHAR), *body)


def _access_mask(access: str) -> int:
    """'rw' → READ|WRITE; anything but r and w is refused (never mknod, never wildcards)."""
    if not access or set(access) - set(_ACCESS_BITS):
        raise ValueError(f"device access {access!r} must be made of 'r' and 'w' only")
    mask = 0
    for char in access:
        mask |= _ACCESS_BITS[char]
    return mask


def extendable(program: Sequence[Insn]) -> str | None:
    """Why *program* cannot be safely prefixed, or None if it can.

    A runtime's device program is straight-line compare-and-return code. Map
    references (64-bit immediate loads), helper calls and a last instruction
    that is not ``exit`` are shapes we do not understand, so we refuse rather
    than risk weakening isolation.
    """
    if not program:
        return "it is empty"
    if program[-1].code != EXIT:
        return "its last instruction is not exit"
    for insn in program:
        if insn.code == LD_IMM64:
            return "it loads 64-bit immediates (maps or pointers)"
        if insn.code == CALL:
            return "it calls kernel helpers"
    return None
