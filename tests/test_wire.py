"""stasis/wire.py (what the client reads and sends) held to the pydantic models the daemon
validates requests with, field by field: the same keys, the same required keys, the same JSON
types. Answers are the wire's typed dicts on both sides: the check report and the Slurm
registrations are checked here value by value as the daemon makes them (the other answers in
tests/test_client.py and tests/daemon/test_api.py, from a real daemon). And the wire and the
client stay cheap to import (no pydantic, typing_extensions, aiohttp)."""

from __future__ import annotations

import datetime
import inspect
import json
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import pydantic
import pytest
from pydantic import BaseModel

from stasis import wire
from stasis.daemon import models as daemon_models
from stasis.errors import NotFoundError
from stasis.slurm import models as slurm_models
from stasis.store import Manifest
from tests.conftest import ROOT

# (the wire's TypedDict, the pydantic model the daemon validates the request with)
REQUEST_PAIRS: list[tuple[type, type[BaseModel]]] = [
    (wire.RunRequest, daemon_models.RunRequest),
    (wire.KillRequest, daemon_models.KillRequest),
    (wire.GcRequest, daemon_models.GcRequest),
    (wire.DumpRequest, daemon_models.DumpRequest),
    (wire.RestoreRequest, daemon_models.RestoreRequest),
    (wire.RegisterRequest, slurm_models.RegisterRequest),
    (wire.FinishRequest, slurm_models.FinishRequest),
    (wire.SlurmCheckpointRequest, slurm_models.CheckpointRequest),
]
# The answers: the daemon builds them as the wire's typed dicts themselves (mypy holds each
# construction to the wire); what a real daemon sends is checked value by value (`conforms`) in
# tests/test_client.py and tests/daemon/test_api.py, and here where named.
WIRE_ONLY = {
    "WireError",  # test_error_shape
    "Progress",  # the dump and restore streams (tests/daemon/test_api.py)
    "Deleted",  # tests/test_client.py
    "GcAnswer",  # tests/daemon/test_gc.py
    "CheckpointCheck",
    "CompatFact",  # tests/daemon/test_api.py, test_restore_facts.py
    "RekeyAnswer",  # tests/daemon/test_encryption.py
    "Checkpoint",  # a part of the store's Manifest: test_checkpoint_is_part_of_the_manifest
    "VerifyVerdict",  # tests/daemon/test_verify.py (the verify helper holds it to its store record)
    "CheckReport",
    "Problem",
    "NetworkLock",  # test_check_report_is_the_wires
    "Registration",  # test_registration_rows_are_the_wires
    "Health",
    "FinishAnswer",
    "SlurmCheckpointAnswer",  # mypy; Health: tests/test_client.py
    "RunAnswer",
    "Job",
    "KillAnswer",
    "DumpAnswer",
    "DumpCheckAnswer",
    "RestoreAnswer",
    "RestoreFacts",
    "OpenFile",  # the manifest's restore_facts: test_restore_facts_are_recorded
}

_PAIR_IDS = [td.__name__ for td, _ in REQUEST_PAIRS]
_NONE = type(None)


def json_kind(annotation: Any) -> Any:
    """What a value of `annotation` is in JSON: a comparable description, the same for a
    TypedDict's annotation and a pydantic field's of the same shape."""
    if annotation is Any:
        return "any"
    if annotation is _NONE or annotation is None:
        return "null"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return ("literal", frozenset(args))
    if origin is Union or origin is types.UnionType:
        kinds: set[Any] = set()
        for arg in args:
            kind = json_kind(arg)
            kinds |= kind[1] if isinstance(kind, tuple) and kind[0] == "union" else {kind}
        return ("union", frozenset(kinds))
    if origin is list:
        return ("list", json_kind(args[0]))
    if origin is dict:
        return ("dict", json_kind(args[0]), json_kind(args[1]))
    if origin is typing.Annotated:
        return json_kind(args[0])
    if isinstance(annotation, type):
        if annotation is bool:  # before int: bool is an int in Python, not in JSON
            return "bool"
        if annotation in (str, int, float):
            return annotation.__name__
        # pydantic writes datetimes as ISO strings (mode="json"), as the wire reads them.
        if issubclass(annotation, (datetime.datetime, pydantic.AwareDatetime)):
            return "str"
        if issubclass(annotation, BaseModel):
            return (
                "object",
                tuple(
                    sorted(
                        (name, json_kind(f.annotation))
                        for name, f in annotation.model_fields.items()
                    )
                ),
            )
        if typing.is_typeddict(annotation):
            return (
                "object",
                tuple(
                    sorted(
                        (name, json_kind(hint))
                        for name, hint in typing.get_type_hints(annotation).items()
                    )
                ),
            )
    raise AssertionError(f"no JSON kind for {annotation!r}: teach json_kind about it")


def conforms(value: Any, annotation: Any) -> bool:
    """Whether a JSON value (as the daemon builds it) is of the wire's `annotation`."""
    if annotation is Any:
        return True
    if annotation is _NONE or annotation is None:
        return value is None
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return value in args
    if origin is Union or origin is types.UnionType:
        return any(conforms(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items()
        )
    if typing.is_typeddict(annotation):
        hints = typing.get_type_hints(annotation)
        return (
            isinstance(value, dict)
            and set(value) == set(hints)
            and all(conforms(value[k], hints[k]) for k in hints)
        )
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    raise AssertionError(f"cannot check a value of {annotation!r}")


def comment_required(td: type) -> set[str]:
    """The fields wire.py's comments call required in a total=False TypedDict."""
    source = inspect.getsource(td)
    return {m.group(1) for m in re.finditer(r"^\s+(\w+):[^#\n]*#[^\n]*\brequired\b", source, re.M)}


def model_required(model: type[BaseModel]) -> set[str]:
    return {name for name, f in model.model_fields.items() if f.is_required()}


def test_json_kind_tells_shapes_apart() -> None:
    # The comparisons below mean something only if different shapes get different kinds.
    assert json_kind(int) != json_kind(bool) != json_kind(float)
    assert json_kind(str | None) == json_kind(typing.Optional[str]) != json_kind(str)
    assert json_kind(list[str]) != json_kind(list[int])
    assert json_kind(Literal["a", "b"]) != json_kind(Literal["a"])
    assert json_kind(dict[str, bool]) != json_kind(dict[str, str])
    assert json_kind(wire.Problem) != json_kind(wire.Health)
    assert json_kind(wire.KillRequest) == json_kind(daemon_models.KillRequest)
    assert json_kind(wire.KillRequest) != json_kind(daemon_models.DumpRequest)


@pytest.mark.parametrize(("td", "model"), REQUEST_PAIRS, ids=_PAIR_IDS)
def test_same_keys(td: type, model: type[BaseModel]) -> None:
    assert set(typing.get_type_hints(td)) == set(model.model_fields)


@pytest.mark.parametrize(("td", "model"), REQUEST_PAIRS, ids=_PAIR_IDS)
def test_same_json_types(td: type, model: type[BaseModel]) -> None:
    hints = typing.get_type_hints(td)
    for name, field in model.model_fields.items():
        assert json_kind(hints[name]) == json_kind(field.annotation), name


@pytest.mark.parametrize(
    ("td", "model"), REQUEST_PAIRS, ids=[td.__name__ for td, _ in REQUEST_PAIRS]
)
def test_required_keys_of_requests(td: type, model: type[BaseModel]) -> None:
    required: frozenset[str] = td.__required_keys__  # type: ignore[attr-defined]
    if td.__total__:  # type: ignore[attr-defined]
        assert required == set(typing.get_type_hints(td))
        assert model_required(model) == required
    else:
        # total=False lets a client leave any field out; the comments say which it may not.
        assert required == frozenset()
        assert model_required(model) == comment_required(td)


def test_required_keys_the_comments_name() -> None:
    # The parse of the comments finds what is there (and only that).
    assert comment_required(wire.RunRequest) == {"command", "cwd"}
    assert comment_required(wire.RegisterRequest) == {"slurm_job", "pid", "label"}
    assert comment_required(wire.DumpRequest) == set()


def test_conforms_tells_values_apart() -> None:
    problem = {"what": "w", "fix": "f"}
    assert conforms(problem, wire.Problem)
    assert not conforms({**problem, "extra": 1}, wire.Problem)
    assert not conforms({"what": "w"}, wire.Problem)
    assert not conforms({"what": 1, "fix": "f"}, wire.Problem)
    assert conforms(None, str | None) and not conforms(None, str)
    assert not conforms(True, int) and conforms(2, float) and not conforms("2", int)
    assert conforms("running", wire.JobState) and not conforms("gone", wire.JobState)


def test_check_report_is_the_wires() -> None:
    from stasis.config import Settings
    from stasis.engine import check

    report = check.run_check(Settings())
    assert conforms(report, wire.CheckReport), report
    assert report["ok"] is (report["problems"] == [])
    assert all(conforms(lock, wire.NetworkLock) for lock in check.network_locks())


def test_registration_rows_are_the_wires(tmp_path: Path) -> None:
    from stasis.daemon.db import JobDB
    from stasis.slurm.registrations import Registrations, slurm_jobs_table

    hints = typing.get_type_hints(wire.Registration)
    # The table holds a registration's fields, no more, no fewer.
    assert {c.name for c in slurm_jobs_table.columns} == set(hints)
    nullable = {c.name for c in slurm_jobs_table.columns if c.nullable}
    assert nullable == {name for name, hint in hints.items() if conforms(None, hint)}
    reg = wire.Registration(
        slurm_job="12",
        pid=40,
        pid_start=None,
        launcher_pid=39,
        uid=1,
        gid=2,
        user="u",
        label="l",
        explicit_label=False,
        token="t",
        stdout="/o",
        stderr="/e",
        work_dir="/w",
        command=["a", "b"],
        state="running",
        registered="2026-01-01T00:00:00+00:00",
        stop_asked=False,
        final_failed=False,
        stop_checkpoint=None,
        restarts=0,
        restored_from=None,
    )
    db = JobDB(tmp_path / "jobs.db")
    try:
        db.create_tables([slurm_jobs_table])
        regs = Registrations(db)
        regs.save(reg)
        got = regs.get("12")
        assert got == reg and got is not None and conforms(got, wire.Registration)
        assert all(conforms(r, wire.Registration) for r in regs.running())
    finally:
        db.engine.dispose()


def test_checkpoint_is_part_of_the_manifest() -> None:
    hints = typing.get_type_hints(wire.Checkpoint)
    fields = Manifest.model_fields
    assert set(hints) <= set(fields), set(hints) - set(fields)
    for name, hint in hints.items():
        assert json_kind(hint) == json_kind(fields[name].annotation), name
    assert wire.Checkpoint.__required_keys__ == set(hints)
    # Every field the wire reads is always in a manifest's JSON (required or defaulted).
    assert "signature" not in hints and "files" not in hints


def test_restore_facts_are_recorded_as_the_wire_has_them() -> None:
    # The engine gathers and compares wire.RestoreFacts; the manifest stores them as its model.
    from stasis.store import RecordedFacts

    field = Manifest.model_fields["restore_facts"]
    assert json_kind(field.annotation) == json_kind(wire.RestoreFacts | None)
    assert json_kind(RecordedFacts) == json_kind(wire.RestoreFacts)
    assert not field.is_required()  # manifests written before them still read


def test_every_wire_shape_is_held_to_something() -> None:
    shapes = {
        name
        for name, value in vars(wire).items()
        if isinstance(value, type) and typing.is_typeddict(value)
    }
    paired = {td.__name__ for td, _ in REQUEST_PAIRS}
    assert shapes == paired | WIRE_ONLY, shapes ^ (paired | WIRE_ONLY)
    # Every request the daemon reads is validated by a model: none is only a typed dict.
    assert paired >= {name for name in shapes if name.endswith("Request")}


def test_error_shape() -> None:
    from stasis.daemon.http import error_body

    body = error_body(NotFoundError("no job x"))
    assert set(body) == {"error"}
    assert set(body["error"]) == set(typing.get_type_hints(wire.WireError))
    assert body["error"] == {"type": "NotFoundError", "message": "no job x"}


def test_a_private_error_travels_as_the_public_one_it_refines() -> None:
    """A half put-back container root (rootfs.PartlyWritten) must reach the runtime as what it
    is, so that the create fails instead of starting fresh on that root."""
    from stasis.daemon.http import error_body
    from stasis.errors import ContainerRootDamagedError, error_from_wire
    from stasis.k8s.rootfs import PartlyWritten

    body = error_body(PartlyWritten("cannot put back the writable layer: disk full"))
    assert body["error"]["type"] == "ContainerRootDamagedError"
    back = error_from_wire(body["error"]["type"], body["error"]["message"])
    assert type(back) is ContainerRootDamagedError


def test_literals_are_the_daemons() -> None:
    assert json_kind(wire.JobState) == json_kind(daemon_models.JobState)
    compress = daemon_models.DumpRequest.model_fields["compress"].annotation
    assert json_kind(wire.CompressionRequest) == json_kind(compress)
    from stasis.store import manifest

    assert json_kind(wire.CompressionRequest) == json_kind(manifest.CompressionRequest)
    assert json_kind(wire.Compression) == json_kind(manifest.Compression)


def _modules_after(statement: str) -> set[str]:
    code = f"{statement}; import sys, json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
        timeout=60,
    )
    return set(json.loads(out.stdout))


_HEAVY = ("pydantic", "typing_extensions", "aiohttp")


def _heavy(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in _HEAVY}


def test_client_and_wire_import_nothing_heavy() -> None:
    loaded = _modules_after("import stasis.client, stasis.wire")
    assert {"stasis.client", "stasis.wire", "stasis.errors"} <= loaded
    assert _heavy(loaded) == set()
    # The check sees them when they are there: the daemon's models pull pydantic in.
    assert "pydantic" in _heavy(_modules_after("import stasis.daemon.models"))
