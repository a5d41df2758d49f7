"""The chart's `<tier>.config` schema, generated from the services' pydantic settings.

    python deploy/k8s/config_schema.py          # rewrite values.schema.json's three `config`
    python deploy/k8s/config_schema.py --check  # exit 1 if the committed schema has drifted

`<tier>.config` maps a settings field name to its value (the chart writes TANDEM_<FIELD>
into the tier's ConfigMap). Its schema lists exactly the fields of that service's settings
class with their types, ranges and choices, and nothing else (additionalProperties: false),
so `helm install` refuses a misspelt key (`cache_byte`) before any pod starts. Nested models
(`transfer`, `internal_tls`, `tracing`) have dedicated chart values and are not listed.
tests/test_helm_chart.py checks the committed file against this generator.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "deploy" / "k8s" / "tandem" / "values.schema.json"
KEEP = ("type", "description", "enum", "minimum", "maximum", "exclusiveMinimum",
        "exclusiveMaximum", "pattern", "items", "anyOf", "minItems", "maxItems")


def _clean(prop: dict) -> dict:
    out = {k: v for k, v in prop.items() if k in KEEP}
    if "anyOf" in out:
        out["anyOf"] = [_clean(p) for p in out["anyOf"]]
    if isinstance(out.get("items"), dict):
        out["items"] = _clean(out["items"])
    return out


def config_schema(cls) -> dict:
    props = cls.model_json_schema()["properties"]
    fields = {name: _clean(p) for name, p in props.items()
              if "$ref" not in p and "allOf" not in p}
    return {"type": "object",
            "description": f"{cls.__name__} fields (snake_case) -> values; generated from the "
                           f"service's settings by deploy/k8s/config_schema.py.",
            "properties": dict(sorted(fields.items())), "additionalProperties": False}


def generated() -> dict:
    sys.path.insert(0, str(ROOT))
    from tandem.services.encoder.config import EncoderConfig
    from tandem.services.language.config import LanguageConfig
    from tandem.services.router.config import RouterConfig

    schema = json.loads(SCHEMA.read_text())
    for tier, cls in (("encoder", EncoderConfig), ("language", LanguageConfig),
                      ("router", RouterConfig)):
        schema["properties"][tier]["properties"]["config"] = config_schema(cls)
    return schema


def main() -> int:
    want = json.dumps(generated(), indent=2) + "\n"
    if "--check" in sys.argv:
        if SCHEMA.read_text() != want:
            print(f"{SCHEMA} has drifted from the services' settings: run "
                  f"python deploy/k8s/config_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(want)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
