"""The wire contract: buf lint is clean, and a field has presence exactly where our code
tells "unset" from zero."""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

ROOT = Path(__file__).resolve().parent.parent
MODULES = ["common", "encoder", "language", "router"]


def _buf() -> str:
    exe = Path(sys.executable).parent / "buf"
    return str(exe) if exe.exists() else (shutil.which("buf") or pytest.skip("buf missing"))


def test_buf_lint_clean():
    r = subprocess.run([_buf(), "lint"], cwd=ROOT / "protos", capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _all_message_classes():
    for name in MODULES:
        mod = importlib.import_module(f"tandem.v1.{name}_pb2")
        for desc in mod.DESCRIPTOR.message_types_by_name.values():
            yield desc.full_name, getattr(mod, desc.name)


def _has_field_reads() -> dict[str, list[str]]:
    """name -> where: every `x.HasField("name")` in tandem/ and services/ (stubs aside)."""
    out: dict[str, list[str]] = {}
    for pkg in ("tandem", "services"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("tandem/v1/"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "HasField" and node.args
                        and isinstance(node.args[0], ast.Constant)):
                    out.setdefault(node.args[0].value, []).append(f"{rel}:{node.lineno}")
    return out


def _optional_scalars(fields) -> set[str]:
    """Scalars declared `optional` (proto3 presence: a synthetic oneof of their own)."""
    return {f"{f.containing_type.full_name}.{f.name}" for f in fields
            if f.has_presence and f.type != FieldDescriptor.TYPE_MESSAGE
            and f.containing_oneof is not None and f.containing_oneof.name == f"_{f.name}"}


def _all_fields():
    return [f for _, cls in _all_message_classes() for f in cls.DESCRIPTOR.fields]


def test_fields_read_for_presence_have_it():
    """Where the code asks whether a field was set (`seed`: 0 is a seed, unset draws one),
    the field must carry presence (`optional`, a message, a oneof member): on a plain
    proto3 scalar, 0 and unset are the same bytes, and HasField raises at run time."""
    reads = _has_field_reads()
    assert "seed" in reads  # the scan sees the code
    fields, oneofs = _all_fields(), {o.name for _, c in _all_message_classes()
                                     for o in c.DESCRIPTOR.oneofs}
    wrong = []
    for name, lines in sorted(reads.items()):
        where = ", ".join(lines)
        named = [f for f in fields if f.name == name]
        if not named and name not in oneofs:
            wrong.append(f"{name} (read at {where}): no such field in protos/tandem/v1")
        for f in named:
            if not f.has_presence:
                wrong.append(f"{f.full_name} (read at {where}): no presence; declare it "
                             f"`optional` or stop asking whether it was set")
    assert wrong == [], "\n".join(wrong)


def test_every_optional_scalar_is_read_for_presence():
    """A scalar is `optional` only because its zero is a value and unset means something
    else: then some code must tell the two apart (HasField), or the presence is dead. The
    sampling knobs' presence is read by one table (tandem.sampling.from_proto)."""
    from tandem.sampling import KNOBS

    reads, optional = _has_field_reads(), _optional_scalars(_all_fields())
    assert "tandem.v1.SamplingParams.seed" in optional  # the scan sees presence
    by_table = {f"tandem.v1.SamplingParams.{k.name}" for k in KNOBS}
    unread = sorted(f for f in optional
                    if f.rpartition(".")[2] not in reads and f not in by_table)
    assert unread == [], f"optional but never read with HasField: {unread}"


def test_sampling_knobs_are_the_protos_scalars_with_presence_where_zero_is_not_default():
    """tandem.sampling.KNOBS is the one table of SamplingParams' scalars: each row names a
    field of the proto, every scalar field has a row, and a field has presence exactly
    where its default is not its zero (absent then travels as absent, never as 0)."""
    from tandem.sampling import KNOBS, SamplingParams, from_proto, to_proto
    from tandem.v1 import common_pb2

    fields = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    scalars = {n for n, f in fields.items() if f.type != FieldDescriptor.TYPE_MESSAGE
               and not f.is_repeated}
    assert {k.name for k in KNOBS} == scalars
    for k in KNOBS:
        zero_is_default = k.default is not None and k.default == 0
        assert fields[k.name].has_presence == (not zero_is_default), k
    # absent knobs come back as their defaults; present ones as given
    assert from_proto(common_pb2.SamplingParams()) == SamplingParams()
    given = to_proto(top_p=0.5, repetition_penalty=1.25, max_tokens=7, seed=0)
    got = from_proto(given)
    assert (got.top_p, got.repetition_penalty, got.max_tokens, got.seed) == (0.5, 1.25, 7, 0)


def test_services_have_expected_methods():
    from tandem.v1 import encoder_pb2, language_pb2, router_pb2

    def methods(mod, svc):
        return {m.name for m in mod.DESCRIPTOR.services_by_name[svc].methods}

    assert methods(encoder_pb2, "Encoder") == {"Encode", "Attach", "GetLoad", "EncodeRange"}
    rng = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].methods_by_name["EncodeRange"]
    assert rng.client_streaming and rng.server_streaming  # RangeWrites in, chunks out
    assert methods(language_pb2, "Language") >= {"Generate", "Abort", "GetLoad"}
    assert methods(router_pb2, "Router") == {"Generate", "ListModels"}
    attach = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].methods_by_name["Attach"]
    assert attach.client_streaming and attach.server_streaming
