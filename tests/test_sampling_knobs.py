"""Every sampling knob of tandem.sampling.KNOBS, through every door, from the table itself:
a knob added to the table is covered here without a line of this file changing.

- HTTP (chat and completions): a value in range reaches the wire's SamplingParams as given;
  one out of range is a 400 naming the field.
- The router's gRPC front door: the same value out of range is INVALID_ARGUMENT naming
  `sampling.<knob>`, before any tier is called.
- The SDK: each knob is a keyword of `build_request`; an unknown keyword is a TypeError.
- The language tier reads what the router wrote (`from_proto`), absent knobs as defaults;
  `SamplingParams`, written out, has one field per knob (its type, its default).
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
from fastapi.testclient import TestClient

from tandem import sampling
from tandem.client.errors import InvalidRequestError
from tandem.client.results import build_request
from tandem.services.router.config import RouterConfig
from tandem.services.router.core import RouterCore
from tandem.services.router.errors import RouterError
from tandem.services.router.grpc_api import _validate
from tandem.services.router.openai.app import build_app
from tandem.services.router.openai.chat import ChatCompletionRequest, to_chat_request
from tandem.services.router.openai.completions import CompletionRequest, to_completion_request
from tandem.v1 import common_pb2, router_pb2

CFG = RouterConfig(insecure_internal=True)
HTTP_KNOBS = [k for k in sampling.KNOBS if k.openai]


def inside(k: sampling.Knob):
    """A value in range that is not the default (so it must travel)."""
    if k.type is bool:
        return not k.default
    lo = k.lo if k.lo is not None else 0
    hi = k.hi if k.hi is not None else lo + 8
    if k.type is int:
        return int(lo) + 1 if int(lo) + 1 != k.default else int(lo) + 2
    return lo + (hi - lo) * 0.375 if k.default != lo + (hi - lo) * 0.375 else lo + (hi - lo) / 8


def outside(k: sampling.Knob):
    """A value past one of its bounds (None: a bool has no bounds)."""
    if k.type is bool:
        return None
    if k.hi is not None and k.hi < (1 << 40):
        return k.hi + 1 if k.type is int else k.hi + 0.5
    return (k.lo - 1) if k.type is int else k.lo - 0.5


def chat(**kw) -> dict:
    return {"model": "", "messages": [{"role": "user", "content": "hi"}], **kw}


def test_the_table_names_every_openai_field_it_generates():
    assert {k.name for k in HTTP_KNOBS} <= set(ChatCompletionRequest.model_fields)
    assert {k.name for k in HTTP_KNOBS} <= set(CompletionRequest.model_fields)
    assert "typical_p" in {k.name for k in HTTP_KNOBS}  # the knob added as a demonstration


@pytest.mark.parametrize("knob", HTTP_KNOBS, ids=lambda k: k.name)
def test_a_knob_in_range_reaches_the_wire_over_http(knob):
    value = inside(knob)
    req = to_chat_request(ChatCompletionRequest.model_validate(chat(**{knob.name: value})), "x")
    assert getattr(req.sampling, knob.name) == pytest.approx(value, rel=1e-6)
    cmpl = to_completion_request(CompletionRequest.model_validate(
        {"model": "", "prompt": "hi", knob.name: value}), "x")
    assert getattr(cmpl.sampling, knob.name) == pytest.approx(value, rel=1e-6)
    # ... and the language tier reads it as given
    assert getattr(sampling.from_proto(req.sampling), knob.name) == pytest.approx(value, rel=1e-6)


@pytest.mark.parametrize("knob", [k for k in HTTP_KNOBS if outside(k) is not None],
                         ids=lambda k: k.name)
def test_a_knob_out_of_range_is_refused_by_name_at_both_doors(knob):
    client = TestClient(build_app(RouterCore(CFG)))
    r = client.post("/v1/chat/completions", json=chat(**{knob.name: outside(knob)}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == knob.name
    # the gRPC door: a value the wire can carry is refused there; one it cannot carry
    # (a seed past 64 bits) is refused by the SDK before it is sent
    try:
        sent = sampling.to_proto(**{knob.name: outside(knob)})
    except sampling.SamplingError as e:
        assert e.field == knob.name
        return
    message = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="hi")])
    with pytest.raises(RouterError) as e:
        _validate(router_pb2.RouterGenerateRequest(messages=[message], sampling=sent))
    assert (e.value.code, e.value.param) == ("INVALID_ARGUMENT", f"sampling.{knob.name}")


@pytest.mark.parametrize("knob", sampling.KNOBS, ids=lambda k: k.name)
def test_every_knob_is_an_sdk_keyword(knob):
    value = inside(knob)
    got = build_request("hi", **{knob.name: value}).sampling
    assert getattr(got, knob.name) == pytest.approx(value, rel=1e-6)


def test_an_unknown_sdk_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="typical_q"):
        build_request("hi", typical_q=0.5)
    with pytest.raises(InvalidRequestError) as e:
        build_request("hi", typical_p=0)
    assert e.value.field == "sampling.typical_p"


def test_absent_knobs_are_the_defaults_and_the_wire_stays_empty():
    assert build_request("hi").sampling == common_pb2.SamplingParams()
    got = sampling.from_proto(common_pb2.SamplingParams())
    assert {k.name: getattr(got, k.name) for k in sampling.KNOBS} == {
        k.name: k.default for k in sampling.KNOBS}


def test_top_k_minus_one_is_off_as_in_vllm():
    req = to_chat_request(ChatCompletionRequest.model_validate(chat(top_k=-1)), "x")
    assert req.sampling.top_k == -1 and sampling.from_proto(req.sampling).top_k == -1


def test_sampling_params_fields_are_the_knob_table():
    """SamplingParams is written out (readers and type checkers see its fields); its
    fields are the table's knobs, in order, each of its knob's type and default, then the
    fields that are not scalars."""
    fields = dataclasses.fields(sampling.SamplingParams)
    knobs = fields[:len(sampling.KNOBS)]
    assert [f.name for f in knobs] == [k.name for k in sampling.KNOBS]
    hints = typing.get_type_hints(sampling.SamplingParams)
    for f, k in zip(knobs, sampling.KNOBS, strict=True):
        assert f.default == k.default and type(f.default) is type(k.default), k.name
        assert hints[f.name] == (k.type if k.default is not None else k.type | None), k.name
    assert [f.name for f in fields[len(sampling.KNOBS):]] == [
        "stop", "stop_token_ids", "logit_bias", "grammar"]
