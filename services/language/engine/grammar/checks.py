"""What a structured-output spec may ask of the compiler, checked before any compile:
size limits (bytes, enum characters, counts, properties, depth), `$ref` loops that never
reach a schema, and whether a spec is light (the light-only slot's)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tandem.errors import ServiceError
from tandem.sampling import GrammarKind, GrammarSpec

# A counted repetition in a regex or EBNF rule: x{n}, x{n,}, x{n,m}
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# JSON-schema keywords whose value is a count the compiled grammar unrolls
_COUNT_KEYS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties",
               "minProperties")


class GrammarError(ServiceError):
    """A structured-output spec that is refused: it does not compile, is over a limit, or
    admits no output."""

    code = "INVALID_ARGUMENT"
    field = "response_format"


@dataclass(frozen=True)
class GrammarLimits:
    """What one structured-output spec may ask of the compiler (LanguageConfig's
    grammar_* fields document each)."""

    compile_timeout_s: float = 10.0
    max_compile_cpu_s: float = 0.5
    workers: int = 2
    max_spec_bytes: int = 256 << 10
    max_enum_values: int = 4096
    max_enum_chars: int = 32 << 10
    max_count: int = 4096
    max_properties: int = 4096
    max_depth: int = 32
    cache_bytes: int = 256 << 20


# A light spec: what a typical response_format schema is, and what the light-only slot
# takes. Compiling one takes milliseconds (tens on a 150,000-token vocabulary); one that
# still runs past LIGHT_CPU_S on that slot is moved to the other lane.
LIGHT_MAX_BYTES = 8 << 10
LIGHT_MAX_ENUM_CHARS = 4 << 10
LIGHT_MAX_COUNT = 256
LIGHT_CPU_S = 0.25


@dataclass(frozen=True)
class SpecCost:
    """What check_spec read of a spec's cost: its bytes, the characters of its enum values
    (or choices), which the compiled grammar matches one by one, and its largest count."""

    bytes: int = 0
    enum_chars: int = 0
    largest_count: int = 0

    @property
    def light(self) -> bool:
        return (self.bytes <= LIGHT_MAX_BYTES and self.enum_chars <= LIGHT_MAX_ENUM_CHARS
                and self.largest_count <= LIGHT_MAX_COUNT)


def check_spec(spec: GrammarSpec, limits: GrammarLimits) -> SpecCost:
    """Refuse a spec over a limit before it reaches the compiler (GrammarError); else what
    it costs, as far as its text says."""
    size = len(spec.text.encode())
    if size > limits.max_spec_bytes:
        raise GrammarError(f"the {spec.kind.value} is {size} bytes, over the limit of "
                           f"{limits.max_spec_bytes} (grammar_max_spec_bytes)")
    enum_chars = largest = 0
    match spec.kind:
        case GrammarKind.JSON_SCHEMA:
            try:
                schema = json.loads(spec.text)
            except ValueError:
                raise GrammarError("the JSON schema is not valid JSON") from None
            enum_chars, largest = _check_schema(schema, limits)
            _check_ref_cycles(schema)
        case GrammarKind.CHOICE:
            choices = json.loads(spec.text)
            n = len(choices)
            if n > limits.max_enum_values:
                raise GrammarError(f"{n} choices, over the limit of {limits.max_enum_values} "
                                   "(grammar_max_enum_values)")
            enum_chars = sum(len(str(x)) for x in choices)
            _check_enum_chars(enum_chars, "choices", limits)
        case GrammarKind.REGEX | GrammarKind.EBNF:
            largest = _check_repeats(spec.text, spec.kind.value, limits)
    return SpecCost(size, enum_chars, largest)


def _check_enum_chars(n: int, what: str, limits: GrammarLimits) -> None:
    if n > limits.max_enum_chars:
        raise GrammarError(f"the {what} have {n} characters in all, over the limit of "
                           f"{limits.max_enum_chars} (grammar_max_enum_chars)")


def _check_repeats(text: str, what: str, limits: GrammarLimits) -> int:
    """The largest counted repetition in `text` (0: none); GrammarError over the limit."""
    largest = 0
    for m in _REPEAT.finditer(text):
        n = max(int(m.group(1)), int(m.group(2) or 0))
        if n > limits.max_count:
            raise GrammarError(f"the {what} repeats {n} times ({m.group(0)}), over the limit "
                               f"of {limits.max_count} (grammar_max_count)")
        largest = max(largest, n)
    return largest


# Keys whose value is data, not a schema: a schema's walk does not go into them (a flat
# 4,000-value enum is 4,000 strings it would otherwise push and pop one by one). Keys whose
# value maps names to schemas: every value there is a schema, whatever its name (a
# property called "enum" is walked like any other).
_DATA = frozenset({"enum", "const", "default", "examples"})
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas", "dependencies"})


def _children(node: dict, is_map: bool):
    """(child, is_map) for each dict or list under a schema node (or a map of them)."""
    for k, v in node.items():
        if isinstance(v, dict | list) and (is_map or k not in _DATA):
            yield v, not is_map and k in _MAPS


def _literal_chars(value) -> int:
    """Characters the compiled grammar matches for one enum or const value."""
    return len(value) if isinstance(value, str) else len(json.dumps(value))


def _check_schema(schema, limits: GrammarLimits) -> tuple[int, int]:
    """Walk the schema once: nesting depth, enum values (and their characters) and
    properties in total, and every count the compiled grammar unrolls (string lengths,
    array and object sizes, a pattern's repetitions). Returns (enum characters, the
    largest count)."""
    enums = props = chars = largest = 0
    stack = [(schema, 1, False)]
    while stack:
        node, depth, is_map = stack.pop()
        if depth > limits.max_depth:
            raise GrammarError(f"the JSON schema nests deeper than {limits.max_depth} "
                               "(grammar_max_depth)")
        if isinstance(node, list):
            stack.extend((x, depth + 1, False) for x in node)
            continue
        if not isinstance(node, dict):
            continue
        stack.extend((v, depth + 1, m) for v, m in _children(node, is_map))
        if is_map:
            continue
        if isinstance(node.get("enum"), list):
            enums += len(node["enum"])
            chars += sum(_literal_chars(v) for v in node["enum"])
        if "const" in node:
            chars += _literal_chars(node["const"])
        if isinstance(node.get("properties"), dict):
            props += len(node["properties"])
        for key in _COUNT_KEYS:
            v = node.get(key)
            if isinstance(v, int | float) and v > limits.max_count:
                raise GrammarError(f"{key} {v} is over the limit of {limits.max_count} "
                                   "(grammar_max_count)")
            if isinstance(v, int | float):
                largest = max(largest, int(v))
        if isinstance(node.get("pattern"), str):
            largest = max(largest, _check_repeats(node["pattern"], "pattern", limits))
    if enums > limits.max_enum_values:
        raise GrammarError(f"the JSON schema has {enums} enum values, over the limit of "
                           f"{limits.max_enum_values} (grammar_max_enum_values)")
    _check_enum_chars(chars, "JSON schema's enum and const values", limits)
    if props > limits.max_properties:
        raise GrammarError(f"the JSON schema has {props} properties, over the limit of "
                           f"{limits.max_properties} (grammar_max_properties)")
    return chars, largest


# Keys that say nothing about the value a schema admits: a node with only these beside its
# `$ref` admits exactly what the reference admits.
_ANNOTATIONS = frozenset({"$ref", "$id", "$schema", "$comment", "$defs", "definitions",
                          "title", "description", "default", "examples", "deprecated",
                          "readOnly", "writeOnly"})


def no_output_error(kind: GrammarKind, why: str) -> GrammarError:
    """The one refusal for a spec that admits no output, whichever check finds it (the
    static `$ref` walk below or the compiled grammar's first mask): Tandem's words, so the
    answer does not change with the grammar engine's version or which layer noticed first."""
    return GrammarError(f"the {kind.value} admits no output at all ({why})")


def _check_ref_cycles(schema) -> None:
    """Refuse a schema with a `$ref` chain that returns to itself through nodes that are
    nothing but references (`{"$ref": "#/$defs/n"}` inside `n`): no value can ever satisfy
    it. Checked here rather than left to the compiler, whose versions disagree on whether
    and how they report it (xgrammar 0.2.9 refuses it with its own message, 0.2.8 compiles
    a grammar that masks every token). Only local JSON pointers (`#/...`) from the document
    root are followed: a subschema with its own `$id` changes what `#` means inside it, so
    neither the walk nor a pointer enters one; those, and anything else, are the compiler's
    to judge."""
    def resolve(ref: str):
        node = schema
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
            if isinstance(node, dict) and "$id" in node:
                return None  # another base: its `#` is not this document's
        return node

    def pure_ref(node) -> str | None:
        if isinstance(node, dict) and isinstance(node.get("$ref"), str) \
                and node["$ref"].startswith("#") and node.keys() <= _ANNOTATIONS:
            return node["$ref"]
        return None

    stack = [(schema, False)]
    while stack:
        node, is_map = stack.pop()
        if isinstance(node, list):
            stack.extend((x, False) for x in node)
            continue
        if not isinstance(node, dict) or (node is not schema and "$id" in node):
            continue
        stack.extend(_children(node, is_map))
        if is_map:
            continue
        chain, seen, ref = [], set(), pure_ref(node)
        while ref is not None:
            if ref in seen:
                loop = " -> ".join(chain[chain.index(ref):] + [ref])
                raise no_output_error(GrammarKind.JSON_SCHEMA,
                                      f"the $ref chain {loop} never reaches a schema")
            seen.add(ref)
            chain.append(ref)
            ref = pure_ref(resolve(ref))
