"""The wire-format facts of a flatbuffers ``.fbs`` schema, as plain data.

``facts(text)`` reads the declarations that decide the bytes (namespace, file identifier,
root type, enums with their values, unions with their members in tag order, tables and
structs with their fields in slot order, each field's type, default and attributes) and
leaves out comments and layout.  Two schemas with equal facts have the same wire format.
The facts of the project's seed schema are committed as ``golden/seed_schema_facts.json``,
so the schema tests need no file outside the repository.
"""

from __future__ import annotations

import re
from typing import Any

_FIELD = re.compile(r"(\w+)\s*:\s*([^;=(]+?)\s*(?:=\s*([^;(]+?)\s*)?(?:\(([^)]*)\))?\s*;")


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def facts(text: str) -> dict[str, Any]:
    """Namespace, identifier, root type, enums, unions, tables and structs of ``text``."""
    text = _strip_comments(text)

    def one(keyword: str) -> str | None:
        found = re.search(rf"\b{keyword}\s+\"?([\w.]+)\"?\s*;", text)
        return found.group(1) if found else None

    enums = {}
    for name, base, body in re.findall(r"\benum\s+(\w+)\s*:\s*(\w+)\s*\{(.*?)\}", text, re.S):
        members, value = [], -1
        for item in (m.strip() for m in body.split(",")):
            if item:
                member, _, given = (part.strip() for part in item.partition("="))
                value = int(given, 0) if given else value + 1
                members.append([member, value])
        enums[name] = {"type": base, "members": members}
    unions = {}
    for name, body in re.findall(r"\bunion\s+(\w+)\s*\{(.*?)\}", text, re.S):
        members = []
        for item in (m.strip() for m in body.split(",")):
            if item:
                member, _, table = (part.strip() for part in item.partition(":"))
                members.append([member, table or member])
        unions[name] = members
    compound: dict[str, dict[str, list[list[Any]]]] = {"table": {}, "struct": {}}
    for kind, name, body in re.findall(r"\b(table|struct)\s+(\w+)\s*\{(.*?)\}", text, re.S):
        compound[kind][name] = [
            [field, ftype.replace(" ", ""), default.strip() if default else None,
             re.sub(r"\s+", " ", attrs.strip()) if attrs else None]
            for field, ftype, default, attrs in _FIELD.findall(body)
        ]
    return {"namespace": one("namespace"), "file_identifier": one("file_identifier"),
            "root_type": one("root_type"), "enums": enums, "unions": unions,
            "tables": compound["table"], "structs": compound["struct"]}
