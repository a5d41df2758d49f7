"""What the router's OpenAPI document (`/openapi.json`) says each route can answer.

FastAPI documents 200 and its own 422 only; this router never answers 422 (a body that
does not validate is a 400 in OpenAI's error shape, app.py's handler) and does answer the
statuses below, each with OpenAI's error body: the API routes declare `ERROR_RESPONSES`
(`@app.post(..., responses=ERROR_RESPONSES)`), and `document(app)` drops the 422s.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


# Every status the router's request handlers answer besides 200 (docs/sdk.md has the table).
ERROR_STATUSES = {
    400: "malformed JSON, a field that does not validate, an input the model cannot take",
    401: "API key missing or wrong",
    404: "unknown model",
    408: "the request was not received within http_request_timeout_s",
    413: "the body, an image or the request over a limit (permanent: not retried)",
    429: "the router is at its in-flight limit: retry later",
    500: "an internal error",
    503: "no healthy instance of a tier, or the router is draining",
    504: "the request's deadline passed",
}
ERROR_RESPONSES = {code: {"model": ErrorBody, "description": text}
                   for code, text in ERROR_STATUSES.items()}


def document(app: FastAPI) -> None:
    """Leave FastAPI's 422 (never sent) out of the app's OpenAPI document."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for methods in schema.get("paths", {}).values():
                for op in methods.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
