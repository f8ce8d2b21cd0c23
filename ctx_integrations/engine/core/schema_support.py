"""Which JSON-schema keywords structured output enforces, and the check that refuses every other one by name.

xgrammar (0.2.9) compiles a schema into a grammar and drops, without a word, what the grammar cannot say:
``uniqueItems``, ``not``, ``if``/``then``/``else``, ``contains``, a remote ``$ref``, a ``maxLength`` beside a
``format``... An answer held to such a grammar can break the schema and still be reported finished. So every
schema is walked before it is compiled (:func:`check_schema`, from ``structured._schema_text``) and refused,
as OpenAI's strict mode refuses what it does not support, with an
:class:`~ctx_integrations.errors.UnsupportedSchemaError` that names the keyword, where it is and what to do.

What is enforced was found by experiment, not read from xgrammar's documentation: for each keyword a schema
was compiled and a matcher fed a value that breaks it (``tests/test_schema_support.py`` keeps doing so for every
entry of :data:`ENFORCED`, and docs/python.md lists the same tables). Annotations (:data:`ANNOTATIONS`) and
keys that are no JSON-schema keyword (``discriminator``, ``x-...``: no validator checks them) are accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ctx_integrations.errors import UnsupportedSchemaError

# Levels of nesting (objects and arrays, anywhere in the schema): deeper schemas are refused before any recursive
# code (json's parser, bounded_integers, xgrammar's converter) sees them; generated schemas stay far below
MAX_SCHEMA_DEPTH = 100

# keyword -> the condition under which xgrammar holds every answer to it
ENFORCED: dict[str, str] = {
    "type": "a type name or a list of them",
    "enum": "alone, or beside a `type` every listed value has",
    "const": "alone, or beside a `type` the value has",
    "minLength": 'with `"type": "string"`; not beside `pattern` or `format`',
    "maxLength": 'with `"type": "string"`; not beside `pattern` or `format`',
    "pattern": 'with `"type": "string"`, matched against the whole string; no lookahead; not beside `format` '
               "or a length",
    "format": 'with `"type": "string"`, one of the formats listed below; not beside `pattern` or a length',
    "minimum": 'with `"type": "integer"` or `"number"`',
    "maximum": 'with `"type": "integer"` or `"number"`',
    "exclusiveMinimum": 'with `"type": "integer"` or `"number"`',
    "exclusiveMaximum": 'with `"type": "integer"` or `"number"`',
    "items": "a schema (not a list: that is `prefixItems`)",
    "prefixItems": "a list of schemas",
    "unevaluatedItems": "a schema",
    "minItems": 'with `"type": "array"`, `items` or `prefixItems`',
    "maxItems": 'with `"type": "array"`, `items` or `prefixItems`',
    "properties": "a schema per name",
    "required": "names that `properties` declares",
    "additionalProperties": "a schema",
    "unevaluatedProperties": "a schema",
    "patternProperties": 'with `"type": "object"` or `properties`; a schema per pattern',
    "propertyNames": 'with `"type": "object"`, and no `properties`',
    "minProperties": 'with `"type": "object"` or `properties`',
    "maxProperties": 'with `"type": "object"` or `properties`',
    "anyOf": "beside annotations only",
    "oneOf": "beside annotations only, with branches no value can match twice (distinct types, or a required "
             "property whose `const` or `enum` differs per branch, as pydantic's discriminated unions)",
    "allOf": "one schema, beside annotations only",
    "$ref": "a local reference (`#`, `#/$defs/...`, any JSON pointer into the schema), beside annotations only",
    "$defs": "schemas to refer to",
    "definitions": "schemas to refer to",
}

# keyword -> what to do instead
REFUSED: dict[str, str] = {
    "multipleOf": "drop it, or list the values with `enum` (xgrammar keeps to it only over small ranges)",
    "uniqueItems": "drop it and remove duplicates from the answer yourself (`uniqueItems: false` is accepted)",
    "contains": "drop it, or list the values with `prefixItems`",
    "minContains": "drop it, or list the values with `prefixItems`",
    "maxContains": "drop it, or list the values with `prefixItems`",
    "additionalItems": "use `prefixItems` for the first items and `items` for the rest",
    "not": "write what is allowed instead (`enum`, `anyOf`, bounds)",
    "if": "write the cases as `anyOf` branches",
    "then": "write the cases as `anyOf` branches",
    "else": "write the cases as `anyOf` branches",
    "dependentRequired": "make the properties required, or write the cases as `anyOf` branches",
    "dependentSchemas": "write the cases as `anyOf` branches",
    "dependencies": "make the properties required, or write the cases as `anyOf` branches",
    "$dynamicRef": "use a local `$ref`",
    "$recursiveRef": "use a local `$ref`",
    "contentEncoding": "drop it and decode the string yourself, or give a `pattern`",
    "contentMediaType": "drop it and parse the string yourself",
    "contentSchema": "drop it and parse the string yourself",
}

# keywords that say nothing about which values are valid
ANNOTATIONS = frozenset({"title", "description", "examples", "default", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema", "$id", "$anchor", "$dynamicAnchor", "$recursiveAnchor",
                         "$vocabulary"})

ENFORCED_FORMATS = ("date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                    "uri-reference", "uuid", "uri-template", "json-pointer", "relative-json-pointer")
# formats JSON Schema does not define and that restrict no string (pydantic's SecretStr and bytes)
FREE_FORMATS = ("password", "binary")

_KIND = {**dict.fromkeys(("minLength", "maxLength", "pattern", "format"), "string"),
         **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"), "number"),
         **dict.fromkeys(("minItems", "maxItems"), "array"),
         **dict.fromkeys(("patternProperties", "propertyNames", "minProperties", "maxProperties"), "object")}
_IMPLIED = {"properties": "object", "items": "array", "prefixItems": "array"}  # xgrammar infers the kind from these
_CONTAINERS = ("$defs", "definitions")
_SCHEMA_MAPS = ("properties", "patternProperties", *_CONTAINERS)
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMAS = ("items", "additionalProperties", "unevaluatedItems", "unevaluatedProperties", "propertyNames")
_COMBINED = ("anyOf", "oneOf", "allOf", "$ref")  # xgrammar reads these and drops every other constraint beside them
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_DOCS = "the keywords structured output enforces: docs/python.md#structured-output-what-a-json-schema-may-say"


def check_schema(schema: Any) -> None:
    """Refuse a JSON schema (a dict or JSON text) that nests deeper than :data:`MAX_SCHEMA_DEPTH` or uses a keyword,
    or a combination, the grammar cannot enforce; JSON text that does not parse is left to the caller to report.
    Why: xgrammar drops such keywords silently, and answers held to what is left can break the schema."""
    if isinstance(schema, str):
        _check_text_depth(schema)
        try:
            schema = json.loads(schema)
        except ValueError:
            return
    _check_depth(schema)
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, Mapping):
            _check_node(node, path, schema)
            stack.extend(_subschemas(node, path))


def _refuse(keyword: str, path: str, why: str, advice: str) -> UnsupportedSchemaError:
    return UnsupportedSchemaError(f"the JSON schema's {keyword!r} at {path} {why}, so an answer could break the "
                                  f"schema: {advice} ({_DOCS})", keyword, path)


def _check_text_depth(text: str) -> None:
    depth = 0
    for token in _TOKENS.finditer(text):
        bracket = token.group()  # a bracket, or a whole string (whose brackets are text)
        if bracket in ("[", "{"):
            depth += 1
            if depth > MAX_SCHEMA_DEPTH:
                raise _too_deep()
        elif bracket in ("]", "}"):
            depth -= 1


def _check_depth(schema: Any) -> None:
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else None
        if children is None:
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise _too_deep()
        stack.extend((child, depth + 1) for child in children)


def _too_deep() -> UnsupportedSchemaError:
    return UnsupportedSchemaError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels of objects and arrays: "
                                  "flatten it, or name the repeated part in $defs and refer to it with $ref",
                                  "depth", "#")


def _subschemas(node: Mapping, path: str) -> list[tuple[Any, str]]:
    found = []
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), Mapping):
            found += [(value, f"{path}/{key}/{_escape(name)}") for name, value in node[key].items()]
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            found += [(value, f"{path}/{key}/{i}") for i, value in enumerate(node[key])]
    found += [(node[key], f"{path}/{key}") for key in _SCHEMAS if key in node]
    return found


def _check_node(node: Mapping, path: str, root: Any) -> None:
    for keyword in node:
        if keyword in REFUSED and not (keyword == "uniqueItems" and node[keyword] is False):
            raise _refuse(keyword, path, "cannot be enforced by the grammar", REFUSED[keyword])
    if "$id" in node and path != "#":
        raise _refuse("$id", path, "starts a new base for references, which the grammar resolves from the root only",
                      "drop it, or move the schema to $defs")
    constraints = [key for key in node if key in ENFORCED and key not in _CONTAINERS]
    for keyword in _COMBINED:
        if keyword in node:
            _check_alone(keyword, [key for key in constraints if key != keyword], path)
    if "enum" in node or "const" in node:
        _check_listed(node, [key for key in constraints if key not in ("enum", "const", "type")], path)
    _check_kinds(node, constraints, path)
    _check_strings(node, path)
    _check_objects(node, path)
    if isinstance(node.get("items"), list):
        raise _refuse("items", path, "is a list (draft 7's tuples), which the grammar does not read",
                      "use `prefixItems` for the list and `items` for the rest")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) != 1:
        raise _refuse("allOf", path, f"holds {len(node['allOf'])} schemas, and the grammar reads exactly one",
                      "merge them into one schema")
    if isinstance(node.get("oneOf"), list) and not _disjoint(node["oneOf"], root):
        raise _refuse("oneOf", path, "has branches one value could match twice, and the grammar matches any branch",
                      "use `anyOf`, or tell the branches apart by `type` or by a required property's `const`")
    if isinstance(node.get("$ref"), str):
        _check_ref(node["$ref"], path, root)


def _check_alone(keyword: str, others: list[str], path: str) -> None:
    if others:
        raise _refuse(others[0], path, f"stands beside {keyword!r}, and the grammar keeps only {keyword!r}",
                      f"move it into the {keyword!r} schemas")


def _check_listed(node: Mapping, others: list[str], path: str) -> None:
    listed = "enum" if "enum" in node else "const"
    if others:
        raise _refuse(others[0], path, f"stands beside {listed!r}, and the grammar keeps only the listed values",
                      "list only the values that satisfy it")
    values = node.get("enum") if "const" not in node else [node["const"]]
    kinds = _kinds(node)
    if kinds is not None and isinstance(values, list) and not all(_has_kind(value, kinds) for value in values):
        raise _refuse("type", path, f"is not the type of every value {listed!r} lists, and the grammar keeps only "
                      "the listed values", "list only values of that type")


def _kinds(node: Mapping) -> set[str] | None:
    """The types ``node`` declares (``None``: any)."""
    kinds = node.get("type")
    if isinstance(kinds, str):
        return {kinds}
    return {kind for kind in kinds if isinstance(kind, str)} if isinstance(kinds, list) else None


def _has_kind(value: Any, kinds: set[str]) -> bool:
    if isinstance(value, bool):
        return "boolean" in kinds
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return bool(kinds & {"integer", "number"})
    names = {float: "number", str: "string", type(None): "null", list: "array", dict: "object"}
    return any(isinstance(value, kind) and name in kinds for kind, name in names.items())


def _check_kinds(node: Mapping, constraints: list[str], path: str) -> None:
    kinds = _kinds(node)
    if kinds is None:
        kinds = {kind for key, kind in _IMPLIED.items() if key in node}
    if "integer" in kinds:
        kinds.add("number")
    for keyword in constraints:
        kind = _KIND.get(keyword)
        if kind is not None and kind not in kinds:
            raise _refuse(keyword, path, f"applies to {kind}s, and without {kind!r} in the schema's type the grammar "
                          "drops it", f'add "type": "{kind}"')


def _check_strings(node: Mapping, path: str) -> None:
    shapes = [key for key in ("pattern", "format") if key in node]
    if "minLength" in node or "maxLength" in node:
        shapes.append("minLength" if "minLength" in node else "maxLength")
    if len(shapes) > 1:
        raise _refuse(shapes[1], path, f"stands beside {shapes[0]!r}, and the grammar keeps only one of pattern, "
                      "format and length", "put both into one `pattern` (a length as `^.{0,20}$`)")
    pattern = node.get("pattern")
    if isinstance(pattern, str) and _LOOKAROUND.search(pattern):
        raise _refuse("pattern", path, "uses a lookahead or lookbehind, which the grammar drops",
                      "write the pattern without (?=, (?!, (?<= or (?<!")
    fmt = node.get("format")
    if "format" in node and fmt not in ENFORCED_FORMATS + FREE_FORMATS:
        raise _refuse("format", path, f"is {fmt!r}, a format the grammar does not check",
                      f"use one of {', '.join(ENFORCED_FORMATS)}, or a `pattern`")


def _check_objects(node: Mapping, path: str) -> None:
    declared = node.get("properties")
    names = set(declared) if isinstance(declared, Mapping) else set()
    required = node.get("required")
    missing = [name for name in _names(required) if name not in names]
    if missing:
        raise _refuse("required", path, f"names {missing[0]!r}, which `properties` does not declare, and the grammar "
                      "requires only declared properties", f"declare {missing[0]!r} in `properties`")
    if "propertyNames" in node and "properties" in node:
        raise _refuse("propertyNames", path, "stands beside `properties`, whose names the grammar does not check "
                      "against it", "drop it, and from `properties` any name it refuses")


def _check_ref(ref: str, path: str, root: Any) -> None:
    if not ref.startswith("#"):
        raise _refuse("$ref", path, f"is {ref!r}, a reference outside this schema, which the grammar cannot load",
                      "copy the schema it names into $defs and refer to it as #/$defs/<name>")
    if _resolve(ref, root) is _MISSING:
        raise _refuse("$ref", path, f"is {ref!r}, which points at nothing in this schema",
                      "name a schema it holds, such as #/$defs/<name>")


_MISSING = object()


def _resolve(ref: str, root: Any) -> Any:
    """What the local reference ``ref`` (``#`` or ``#/a/b``, RFC 6901 with percent-escapes) points at in ``root``."""
    from urllib.parse import unquote

    pointer = unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        return _MISSING  # an anchor (#name): the grammar does not resolve those
    node = root
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _target(schema: Any, root: Any) -> Any:
    """``schema`` with its chain of local ``$ref``s followed (at most a few steps; a loop is xgrammar's to refuse)."""
    for _ in range(8):
        if not (isinstance(schema, Mapping) and isinstance(schema.get("$ref"), str)):
            break
        schema = _resolve(schema["$ref"], root)
    return schema


def _disjoint(branches: list, root: Any) -> bool:
    """Whether no value can match two of ``branches``: their types differ (integer counts as a number), or each
    requires one property whose ``const`` / ``enum`` values no other branch lists."""
    targets = [_target(branch, root) for branch in branches]
    if not all(isinstance(t, Mapping) for t in targets):
        return len(targets) <= 1
    kinds = [_kinds(t) for t in targets]
    if all(kinds):
        seen: set[str] = set()
        for declared in kinds:
            normal = {"number" if kind == "integer" else kind for kind in declared}
            if seen & normal:
                break
            seen |= normal
        else:
            return True
    common = set.intersection(*(set(_names(t.get("required"))) for t in targets))  # (no targets: True above)
    return any(_tells_apart(name, targets, root) for name in sorted(common))


def _tells_apart(name: str, targets: list[Mapping], root: Any) -> bool:
    seen: set[str] = set()
    for target in targets:
        declared = target.get("properties")
        value = _target(declared.get(name), root) if isinstance(declared, Mapping) else None
        if not isinstance(value, Mapping):
            return False
        listed = [value["const"]] if "const" in value else value.get("enum")
        if not isinstance(listed, list):
            return False
        keys = {json.dumps(item, sort_keys=True) for item in listed}
        if seen & keys:
            return False
        seen |= keys
    return True


def _names(value: Any) -> list[str]:
    """The property names a ``required`` value lists (what is not a string is xgrammar's to refuse)."""
    return [name for name in value if isinstance(name, str)] if isinstance(value, list) else []


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
