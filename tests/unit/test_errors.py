"""The one error tree: every class, wherever it is raised, crosses a process boundary whole and has a stable reason."""

from __future__ import annotations

import importlib
import inspect
import json
import pickle
import pkgutil
import re
from typing import TYPE_CHECKING, Any

import pytest

import gpuhook
from gpuhook import errors
from gpuhook import log as logmod
from gpuhook.errors import GpuHookError, error_from_dict, report_failure

if TYPE_CHECKING:
    from pathlib import Path


def _every_error_class() -> list[type[GpuHookError]]:
    """Every subclass of GpuHookError that gpuhook defines, with every gpuhook module imported first (a class
    defined outside errors.py counts: it must cross process boundaries too)."""
    for module in pkgutil.walk_packages(gpuhook.__path__, "gpuhook."):
        if module.name != "gpuhook.__main__":  # runs the CLI when imported
            importlib.import_module(module.name)

    def tree(cls: type[GpuHookError]) -> list[type[GpuHookError]]:
        return [cls, *(sub for direct in cls.__subclasses__() for sub in tree(direct))]

    return sorted({c for c in tree(GpuHookError) if c.__module__.startswith("gpuhook.")}, key=lambda c: c.__name__)


CLASSES = _every_error_class()

#: A value for each constructor parameter any class takes, by name (a new field needs one here).
SAMPLES: dict[str, Any] = {
    "message": "GPU 1: no room for a 1g.10gb instance", "modprobe": ("nvidia-modprobe", "-u", "-c=0"),
    "step": "mount", "path": "/dev/nvidia0", "errno_": 2, "detail": "the rollback failed too",
}


def _sample(cls: type[GpuHookError]) -> GpuHookError:
    """An instance of *cls* with every parameter its constructor takes set (so each field is checked)."""
    params = [p for p in inspect.signature(cls).parameters.values() if p.kind is not p.VAR_KEYWORD]
    missing = [p.name for p in params if p.name not in SAMPLES]
    assert not missing, f"{cls.__name__} takes {missing}: add a sample value for each to SAMPLES"
    args = [SAMPLES[p.name] for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    kwargs = {p.name: SAMPLES[p.name] for p in params if p.kind is p.KEYWORD_ONLY}
    return cls(*args, **kwargs)


def test_the_walk_finds_the_classes_defined_outside_errors() -> None:
    """The tree below is the whole tree: every class, and each is defined in errors.py (so any process can
    rebuild one without importing the module that raised it)."""
    names = {c.__name__ for c in CLASSES}
    assert {"MissingNodeError", "RequirementError", "UnhealthyGpuError", "MigNoRoomError", "ApplyError"} <= names
    assert [c.__name__ for c in CLASSES if c.__module__ != "gpuhook.errors"] == []


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_pickle_keeps_the_type_and_fields(cls: type[GpuHookError]) -> None:
    """A pickled error (a job handed to a worker, its result) comes back as the same class with the same fields."""
    err = _sample(cls)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert back.fields() == err.fields()
    assert str(back) == str(err)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_to_dict_and_error_from_dict_keep_the_type_and_fields(cls: type[GpuHookError]) -> None:
    """to_dict is JSON (the apply child's report, gpuhookd's answer) and carries the reason; error_from_dict
    rebuilds the same class with the same fields from it."""
    err = _sample(cls)
    data = json.loads(json.dumps(err.to_dict()))
    assert data["kind"] == cls.__name__
    assert data["reason"] == cls.reason
    back = error_from_dict(data)
    assert type(back) is cls
    assert back.fields() == err.fields()
    assert str(back) == str(err)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_each_class_has_its_own_stable_reason(cls: type[GpuHookError]) -> None:
    """A snake_case word, given by the class itself or inherited, and no other class's own word."""
    assert re.fullmatch(r"[a-z]+(_[a-z]+)*", cls.reason), cls.reason
    if "reason" in vars(cls):
        same = [c.__name__ for c in CLASSES if c is not cls and vars(c).get("reason") == cls.reason]
        assert same == [], f"{cls.__name__} and {same} share the reason {cls.reason!r}"


def test_the_reasons_are_the_metrics_labels() -> None:
    """The refusal reasons the metrics counted by class name before the events carried one keep their labels,
    and the MIG refusal the metrics told apart by its message is a class of its own."""
    from gpuhook.daemon.metrics import REASONS

    by_name = {c.__name__: c for c in CLASSES}
    assert {name: by_name[name].reason for name in REASONS} == REASONS
    assert issubclass(errors.MigNoRoomError, errors.BusyError)
    assert errors.MigNoRoomError.reason == "mig_no_room"


def test_missing_node_keeps_its_modprobe_through_json() -> None:
    """JSON makes the modprobe argv a list: the rebuilt error has the tuple again."""
    err = errors.MissingNodeError("/dev/nvidia-uvm is missing", ("nvidia-modprobe", "-u", "-c=0"))
    back = error_from_dict(json.loads(json.dumps(err.to_dict())))
    assert isinstance(back, errors.MissingNodeError)
    assert back.modprobe == ("nvidia-modprobe", "-u", "-c=0")


def test_the_hook_failed_event_carries_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """report_failure logs one hook_failed event with the class, its reason and the user's line."""
    for name in ("_log", "_log_path"):  # the process's log as it was, after the test
        monkeypatch.setattr(logmod, name, getattr(logmod, name))
    path = tmp_path / "gpuhook.log"
    logmod.configure_logging(path, "info")
    line = report_failure(errors.MigNoRoomError("GPU 0: no room for a 7g.80gb instance"))
    assert line == "gpuhook: GPU 0: no room for a 7g.80gb instance"
    [event] = [json.loads(entry) for entry in path.read_text().splitlines()]
    assert (event["event"], event["kind"], event["reason"], event["error"]) == (
        "hook_failed", "MigNoRoomError", "mig_no_room", "GPU 0: no room for a 7g.80gb instance")


def test_no_room_for_a_mig_instance_is_its_own_class() -> None:
    """The refusal "no room for a PROFILE instance" is a MigNoRoomError (a BusyError), not a BusyError told apart
    by its words."""
    from datetime import UTC, datetime

    from gpuhook.request.model import Capability, GpuRequest, MigAsk
    from gpuhook.sharing.ledger import Ledger
    from gpuhook.sharing.mig import no_room

    mig = MigAsk(profile="7g.80gb")
    request = GpuRequest(all_devices=False, devices=(), mig_asks=(mig,), raw="mig=7g.80gb",
                         capabilities=frozenset({Capability.COMPUTE}))
    err = no_room(request, mig, (), Ledger(), datetime.now(UTC))
    assert type(err) is errors.MigNoRoomError
    assert "no room for a 7g.80gb instance" in str(err)
