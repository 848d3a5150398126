"""The device-program block, run in a small interpreter of the opcodes it uses."""

from __future__ import annotations

import pytest

from gpuhook.apply.bpfinsn import (
    ACC_MKNOD,
    ACC_READ,
    ACC_WRITE,
    EXIT,
    LD_IMM64,
    MOV64_K,
    Insn,
    allow_block,
    decode,
    encode,
    extendable,
)

DENY_REST = (Insn(MOV64_K, dst=0, imm=0), Insn(EXIT))  # stands for the runtime's program: deny
ALLOW_NULL = (  # a runtime program that allows c 1:3 (/dev/null) only
    Insn(0x61, dst=2, src=1, off=4), Insn(0x55, dst=2, off=4, imm=1),
    Insn(0x61, dst=2, src=1, off=8), Insn(0x55, dst=2, off=2, imm=3),
    Insn(MOV64_K, dst=0, imm=1), Insn(EXIT), Insn(MOV64_K, dst=0, imm=0), Insn(EXIT),
)


def run(program: tuple[Insn, ...], kind: int, major: int, minor: int, access: int) -> int:
    """Execute *program* on one device access; returns r0."""
    ctx = {0: (access << 16) | kind, 4: major, 8: minor}
    regs = [0] * 11
    pc = 0
    for _ in range(10_000):
        insn = program[pc]
        pc += 1
        if insn.code == 0x61:
            regs[insn.dst] = ctx[insn.off]
        elif insn.code == 0x54:
            regs[insn.dst] = (regs[insn.dst] & (insn.imm & 0xFFFFFFFF)) & 0xFFFFFFFF
        elif insn.code == 0x74:
            regs[insn.dst] = (regs[insn.dst] & 0xFFFFFFFF) >> insn.imm
        elif insn.code == 0xBC:
            regs[insn.dst] = regs[insn.src] & 0xFFFFFFFF
        elif insn.code == 0x55:
            if regs[insn.dst] != insn.imm:
                pc += insn.off
        elif insn.code == MOV64_K:
            regs[insn.dst] = insn.imm
        elif insn.code == EXIT:
            return regs[0]
        else:
            raise AssertionError(f"unexpected opcode {insn.code:#x}")
    raise AssertionError("no exit")


RW = ACC_READ | ACC_WRITE
GPUS = [(195, 1, "rw"), (195, 3, "rw"), (195, 255, "rw"), (511, 0, "rw")]


@pytest.mark.parametrize(
    ("kind", "major", "minor", "access", "expected"),
    [
        pytest.param(2, 195, 1, RW, 1, id="gpu1-rw"),
        pytest.param(2, 195, 3, ACC_READ, 1, id="gpu3-read"),
        pytest.param(2, 511, 0, ACC_WRITE, 1, id="uvm-write"),
        pytest.param(2, 195, 0, RW, 0, id="gpu0-not-granted"),
        pytest.param(2, 195, 1, ACC_MKNOD, 0, id="mknod-never-granted"),
        pytest.param(2, 195, 1, RW | ACC_MKNOD, 0, id="rw-plus-mknod"),
        pytest.param(1, 195, 1, RW, 0, id="block-device-same-numbers"),
        pytest.param(2, 1, 3, RW, 1, id="runtime-default-kept"),
        pytest.param(2, 1, 1, RW, 0, id="dev-mem-still-denied"),
    ],
)
def test_block_allows_exactly_the_gpus(kind: int, major: int, minor: int, access: int, expected: int) -> None:
    """Listed GPUs with r/w are allowed; anything else falls through to the runtime's rules."""
    assert run((*allow_block(GPUS), *ALLOW_NULL), kind, major, minor, access) == expected


def test_read_only_rule_refuses_write() -> None:
    """A rule granting 'r' does not grant 'w'."""
    program = (*allow_block([(195, 0, "r")]), *DENY_REST)
    assert run(program, 2, 195, 0, ACC_READ) == 1
    assert run(program, 2, 195, 0, ACC_WRITE) == 0


def test_no_wildcards_or_mknod_access() -> None:
    """Access strings other than r/w are refused outright."""
    for access in ("rwm", "m", "", "*"):
        with pytest.raises(ValueError, match="'r' and 'w' only"):
            allow_block([(195, 0, access)])


def test_encoding_round_trips() -> None:
    """decode(encode(x)) == x, with registers packed dst low / src high."""
    block = allow_block(GPUS)
    assert decode(encode(block)) == block
    assert Insn(0x61, dst=2, src=1, off=4).encode() == bytes([0x61, 0x12, 4, 0, 0, 0, 0, 0])


def test_unextendable_shapes_are_named() -> None:
    """Maps, helper calls and a missing final exit are refused with a reason."""
    assert extendable(ALLOW_NULL) is None
    assert extendable(()) == "it is empty"
    assert extendable(ALLOW_NULL[:-1]) == "its last instruction is not exit"
    assert "64-bit immediates" in (extendable((Insn(LD_IMM64), *ALLOW_NULL)) or "")
    assert "helpers" in (extendable((Insn(0x85), *ALLOW_NULL)) or "")
