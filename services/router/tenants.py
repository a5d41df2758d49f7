"""Tenants: who a request belongs to (its API key), and the cache namespace that follows.

    api_keys_file (YAML or JSON):
        tenants:
          acme:  {keys: ["sk-acme-1", "sk-acme-2"], max_inflight: 64}
          beta:  {keys: ["sk-beta"]}

A request's bearer token names its tenant (`api_key`, the single shared key, is tenant
"default"). With neither configured the router is open and every request is tenant "".

Why tenants reach the caches: the language tier's prefix cache and the encoder's embedding
cache share work between requests, and what they report (`cached_tokens`,
`cached_image_tokens`, a ViT time of 0) tells a caller whether anyone sent the same prompt
or image before: one tenant could read another's system prompt a guess at a time. So each
request carries a cache namespace (`cache_salt` on the wire), derived here from its tenant
and its own `cache_salt` (vLLM's field): caches are shared only within a namespace, and the
cache figures a caller sees can only come from its own tenant's requests. The namespace is
"" (one shared cache, as before tenants) only for an open router without a request salt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tandem.services.router.errors import RouterError

DEFAULT_TENANT = "default"  # the tenant of the single `api_key`
MAX_CACHE_SALT_CHARS = 256


class TenantSpec(BaseModel):
    """One tenant of the keys file."""

    model_config = ConfigDict(extra="forbid")
    keys: list[str] = Field(min_length=1, description="Its API keys (bearer tokens).")
    max_inflight: int | None = Field(
        None, ge=1, description="Its requests in flight at most (429 past it); unset: only "
        "the router's max_inflight bounds it.")

    @field_validator("keys")
    @classmethod
    def _non_empty(cls, keys: list[str]) -> list[str]:
        if any(len(k.strip()) < 8 for k in keys):
            raise ValueError("every key has at least 8 characters")
        return [k.strip() for k in keys]


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenants: dict[str, TenantSpec] = Field(min_length=1)

    @field_validator("tenants")
    @classmethod
    def _distinct_keys(cls, tenants: dict[str, TenantSpec]) -> dict[str, TenantSpec]:
        seen: dict[str, str] = {}
        for name, spec in tenants.items():
            if not name or len(name) > 64 or not name.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"tenant name {name!r}: 1-64 letters, digits, - or _")
            for key in spec.keys:
                if key in seen:
                    raise ValueError(f"a key of {name!r} is also a key of {seen[key]!r}")
                seen[key] = name
        return tenants


class Tenants:
    """The router's tenants: authentication and cache namespaces."""

    def __init__(self, api_key: str = "", keys_file: str = "") -> None:
        specs: dict[str, TenantSpec] = {}
        if keys_file:
            text = Path(keys_file).read_text()
            data = json.loads(text) if keys_file.endswith(".json") else yaml.safe_load(text)
            specs = dict(TenantsFile.model_validate(data).tenants)
        if api_key:
            if DEFAULT_TENANT in specs:
                raise ValueError(f"tenant {DEFAULT_TENANT!r} is api_key's: name yours otherwise")
            # NOTE: not validated: the single key keeps whatever length it always had
            specs[DEFAULT_TENANT] = TenantSpec.model_construct(keys=[api_key], max_inflight=None)
        self.specs = specs
        self._keys = [(k.encode(), name) for name, s in specs.items() for k in s.keys]

    @property
    def open(self) -> bool:
        """No key configured: every caller is tenant ""."""
        return not self._keys

    @property
    def names(self) -> list[str]:
        return sorted(self.specs)

    def authenticate(self, authorization: str | None) -> str:
        """The tenant whose key `authorization` ("Bearer <key>") carries; UNAUTHENTICATED
        otherwise. Every key is compared (constant time each), so the time taken does not
        tell which tenant's key a guess came close to."""
        if self.open:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode()
        found = ""
        for key, name in self._keys:
            if hmac.compare_digest(given, key) and scheme.lower() == "bearer":
                found = name
        if not found:
            raise RouterError("UNAUTHENTICATED", "missing or invalid API key")
        return found

    def max_inflight(self, tenant: str) -> int | None:
        spec = self.specs.get(tenant)
        return spec.max_inflight if spec else None


def cache_namespace(tenant: str, cache_salt: str | None) -> str:
    """The wire's `cache_salt` for a request of `tenant` with its own `cache_salt`: "" (the
    shared cache) only when both are empty; otherwise 32 hex digits that differ for every
    other (tenant, salt) pair."""
    if cache_salt is not None and len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise RouterError("INVALID_ARGUMENT", f"cache_salt is over {MAX_CACHE_SALT_CHARS} "
                          "characters", "cache_salt")
    if not tenant and not cache_salt:
        return ""
    h = hashlib.sha256(tenant.encode() + b"\0" + (cache_salt or "").encode())
    return h.hexdigest()[:32]
