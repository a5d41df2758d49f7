"""The wire contract: buf lint is clean and every message survives a round trip."""

from __future__ import annotations

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


def _sample(field: FieldDescriptor, depth: int):
    t = field.type
    if t == FieldDescriptor.TYPE_MESSAGE:
        return _filled(field.message_type._concrete_class, depth + 1)
    if t == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values[-1].number
    if t == FieldDescriptor.TYPE_STRING:
        return f"{field.name}-ü"
    if t == FieldDescriptor.TYPE_BYTES:
        return b"\x00\xffbytes"
    if t == FieldDescriptor.TYPE_BOOL:
        return True
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return 0.5
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return (1 << 63) - 7  # rooms are 63-bit
    return -3 if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64) else 3


def _filled(cls, depth: int = 0):
    msg = cls()
    if depth > 4:
        return msg
    seen_oneofs: set[str] = set()
    for f in cls.DESCRIPTOR.fields:
        oneof = f.containing_oneof
        if oneof is not None and not oneof.name.startswith("_"):
            if oneof.name in seen_oneofs:
                continue  # one member per oneof; others are covered by separate cases
            seen_oneofs.add(oneof.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key, val = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            getattr(msg, f.name)[_sample(key, depth)] = _sample(val, depth)
            continue
        value = _sample(f, depth)
        if f.is_repeated:
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, f.name).add().CopyFrom(value)
            else:
                getattr(msg, f.name).extend([value, value])
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(msg, f.name).CopyFrom(value)
        else:
            setattr(msg, f.name, value)
    return msg


def _all_message_classes():
    for name in MODULES:
        mod = importlib.import_module(f"tandem.v1.{name}_pb2")
        for desc in mod.DESCRIPTOR.message_types_by_name.values():
            yield desc.full_name, getattr(mod, desc.name)


@pytest.mark.parametrize("name,cls", list(_all_message_classes()))
def test_round_trip(name, cls):
    msg = _filled(cls)
    back = cls.FromString(msg.SerializeToString())
    assert back == msg
    # Every non-oneof field was set, so the encoding is not trivially empty.
    if cls.DESCRIPTOR.fields:
        assert msg.ByteSize() > 0


@pytest.mark.parametrize(
    "cls_path,member",
    [
        ("encoder_pb2.AttachRequest", "resume"),
        ("encoder_pb2.AttachResponse", "done"),
        ("encoder_pb2.AttachResponse", "failed"),
        ("common_pb2.ContentPart", "image"),
        ("common_pb2.ImagePart", "url"),
    ],
)
def test_round_trip_other_oneof_members(cls_path, member):
    mod_name, cls_name = cls_path.split(".")
    cls = getattr(importlib.import_module(f"tandem.v1.{mod_name}"), cls_name)
    field = cls.DESCRIPTOR.fields_by_name[member]
    msg = cls()
    value = _sample(field, 0)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(msg, member).CopyFrom(value)
    else:
        setattr(msg, member, value)
    back = cls.FromString(msg.SerializeToString())
    assert back == msg and back.WhichOneof(field.containing_oneof.name) == member


def test_services_have_expected_methods():
    from tandem.v1 import encoder_pb2, language_pb2, router_pb2

    def methods(mod, svc):
        return {m.name for m in mod.DESCRIPTOR.services_by_name[svc].methods}

    assert methods(encoder_pb2, "Encoder") == {"Encode", "Attach", "GetLoad"}
    assert methods(language_pb2, "Language") >= {"Generate", "Abort", "GetLoad"}
    assert methods(router_pb2, "Router") == {"Generate", "ListModels"}
    attach = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].methods_by_name["Attach"]
    assert attach.client_streaming and attach.server_streaming
