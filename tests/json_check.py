"""Test-side JSON checks that do not use the grammar library: does a text begin some JSON value, and does a
value follow a JSON Schema (the keywords the structured-output tests use; `jsonschema` cross-checks where it is
installed)."""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_NUMBER_PREFIX = re.compile(r"-|-?(0|[1-9]\d*)(\.\d*)?([eE][+-]?\d*)?")
_ESCAPES = set('"\\/bfnrt')


def _scan_string(text: str, i: int) -> tuple[int | None, bool]:
    """text[i] is '"': (index after the closing quote, or None if the text ends inside, ok)."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == '"':
            return i + 1, True
        if c == "\\":
            if i + 1 == len(text):
                return None, True
            e = text[i + 1]
            if e == "u":
                digits = text[i + 2:i + 6]
                if not re.fullmatch(r"[0-9a-fA-F]*", digits):
                    return None, False
                if len(digits) < 4:
                    return None, True
                i += 6
                continue
            if e not in _ESCAPES:
                return None, False
            i += 2
            continue
        if ord(c) < 0x20:
            return None, False
        i += 1
    return None, True


def is_json_prefix(text: str) -> bool:
    """True if `text` can be continued into exactly one JSON value (whitespace allowed where JSON allows it)."""
    stack: list[str] = []  # closing brackets of the open containers
    expect = "value"  # value | first_value (after '[') | key | first_key (after '{') | colon | after
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\n\r":
            i += 1
            continue
        if expect in ("first_value", "first_key") and c == stack[-1]:
            stack.pop()
            expect, i = "after", i + 1
        elif expect in ("value", "first_value"):
            if c in "{[":
                stack.append("}" if c == "{" else "]")
                expect, i = ("first_key" if c == "{" else "first_value"), i + 1
            elif c == '"':
                end, ok = _scan_string(text, i)
                if not ok or end is None:
                    return ok
                expect, i = "after", end
            elif c == "-" or c.isdigit():
                j = i
                while j < n and text[j] in "+-.eE0123456789":
                    j += 1
                chunk = text[i:j]
                if j == n:
                    return bool(_NUMBER_PREFIX.fullmatch(chunk))
                if not _NUMBER.fullmatch(chunk):
                    return False
                expect, i = "after", j
            elif c.isalpha():
                j = i
                while j < n and text[j].isalpha():
                    j += 1
                chunk = text[i:j]
                if j == n:
                    return any(lit.startswith(chunk) for lit in ("true", "false", "null"))
                if chunk not in ("true", "false", "null"):
                    return False
                expect, i = "after", j
            else:
                return False
        elif expect in ("key", "first_key"):
            if c != '"':
                return False
            end, ok = _scan_string(text, i)
            if not ok or end is None:
                return ok
            expect, i = "colon", end
        elif expect == "colon":
            if c != ":":
                return False
            expect, i = "value", i + 1
        else:  # after a value
            if not stack:
                return False  # something after a complete value
            if c == ",":
                expect, i = ("key" if stack[-1] == "}" else "value"), i + 1
            elif c == stack[-1]:
                stack.pop()
                i += 1
            else:
                return False
    return True


def _has_type(value: Any, t: str) -> bool:
    return {"object": isinstance(value, dict), "array": isinstance(value, list), "string": isinstance(value, str),
            "integer": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "boolean": isinstance(value, bool), "null": value is None}[t]


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b  # JSON: true is not 1


def conforms(value: Any, schema: Any) -> bool:
    """Does `value` follow `schema`? Keywords: type, enum, const, anyOf, properties, required,
    additionalProperties, items, minItems, maxItems, minLength, maxLength, pattern, minimum, maximum."""
    if schema is True or schema == {}:
        return True
    if schema is False:
        return False
    if "anyOf" in schema and not any(conforms(value, s) for s in schema["anyOf"]):
        return False
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        return False
    if "const" in schema and not _same(value, schema["const"]):
        return False
    t = schema.get("type")
    if t is not None and not any(_has_type(value, x) for x in (t if isinstance(t, list) else [t])):
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and any(k not in props for k in value):
            return False
        if not all(conforms(v, props[k]) for k, v in value.items() if k in props):
            return False
    if isinstance(value, list):
        if "items" in schema and not all(conforms(v, schema["items"]) for v in value):
            return False
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            return False
        if "pattern" in schema and not re.search(schema["pattern"], value):
            return False
    if _has_type(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            return False
        if "maximum" in schema and value > schema["maximum"]:
            return False
    return True


def check_against(value: Any, schema: Any) -> None:
    """AssertionError unless `value` follows `schema` (also by `jsonschema`, where it is installed)."""
    assert conforms(value, schema), (value, schema)
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(value, schema)
