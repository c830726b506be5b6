"""An answer's constraint compiled to an llguidance grammar: a JSON schema (optionally wrapped in literal text and
repeated), or a regular expression, a choice of literal texts or a Lark grammar (vLLM's structured outputs)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from llguidance import LLMatcher

# A schema is compiled once per distinct text; larger ones are refused before anything is queued.
MAX_SCHEMA_BYTES = 64 * 1024
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Compact JSON: a grammar that allows free whitespace lets a model pad an answer with blanks until it runs out of
# tokens, and no client needs the blanks.
COMPACT = {"whitespace_flexible": False}


class StructureError(ValueError):
    """The constraint cannot be compiled; the message says what is wrong with it."""


@dataclass(frozen=True)
class Structure:
    """An answer that is one JSON value matching `schema` (any JSON object when None), between `begin` and `end`;
    with `repeat`, one or more of those, joined by `separator` (parallel tool calls, say).

    `lazy`: the answer is free text until the model writes `begin`; from there the value and `end` are held to
    the grammar, and then text is free again (tool_choice "auto"). The text can never hold `begin` otherwise,
    and without `repeat` only one value is written."""

    schema: dict[str, Any] | None = None
    begin: str = ""
    end: str = ""
    repeat: bool = False
    separator: str = "\n"
    lazy: bool = False
    # In place of a JSON value, the whole answer: one match of `regex`, one of the texts of `choice`, or what the
    # Lark grammar `lark` (llguidance's dialect) derives from its `start` rule.
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    lark: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The job's form of it (plain JSON), read back by `from_json`."""
        other = {name: list(value) if name == "choice" else value
                 for name in ("regex", "choice", "lark") if (value := getattr(self, name)) is not None}
        return {"schema": self.schema, "begin": self.begin, "end": self.end, "repeat": self.repeat,
                "separator": self.separator, **({"lazy": True} if self.lazy else {}), **other}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Structure:
        return cls(schema=data.get("schema"), begin=data.get("begin", ""), end=data.get("end", ""),
                   repeat=bool(data.get("repeat", False)), separator=data.get("separator", "\n"),
                   lazy=bool(data.get("lazy", False)), regex=data.get("regex"),
                   choice=tuple(data["choice"]) if data.get("choice") is not None else None, lark=data.get("lark"))

    @property
    def what(self) -> str:
        """What the constraint is, for its error messages."""
        return "regex" if self.regex is not None else "choice" if self.choice is not None else \
            "grammar" if self.lark is not None else "JSON schema"

    @property
    def key(self) -> str:
        """Text of the whole constraint: equal keys compile to the same grammar. Keys keep their order: a schema's
        `properties` order is the order the answer writes them in (a tool call's name before its arguments)."""
        return json.dumps(self.to_json(), separators=(",", ":"))

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form), checked: raises StructureError when it does not compile."""
        return _grammar(self.key)

    def check(self) -> None:
        """Raise StructureError, with the reason, unless the constraint compiles."""
        self.grammar()


@lru_cache(maxsize=256)
def _grammar(key: str) -> str:
    data = json.loads(key)
    if any(data.get(name) is not None for name in ("regex", "choice", "lark")):
        return _text_grammar(key, data)
    schema = data["schema"] if data["schema"] is not None else ANY_OBJECT
    if not isinstance(schema, dict):
        raise StructureError("The JSON schema must be a JSON object.")
    if len(key) > MAX_SCHEMA_BYTES:
        raise StructureError(f"The JSON schema is longer than {MAX_SCHEMA_BYTES // 1024} KiB; send a smaller one.")
    schema = {**schema, "x-guidance": {**COMPACT, **schema.get("x-guidance", {})}}
    lazy = _lazy(data["begin"], data["end"], data["repeat"], schema) if data.get("lazy") else None

    def make() -> str:
        if lazy is not None:
            return LLMatcher.grammar_from_lark(lazy)
        if not (data["begin"] or data["end"] or data["repeat"]):
            return LLMatcher.grammar_from_json_schema(schema)
        item = f"item: {json.dumps(data['begin'])} value {json.dumps(data['end'])}\n" if data["begin"] or \
            data["end"] else "item: value\n"
        start = f"start: item ({json.dumps(data['separator'])} item)*\n" if data["repeat"] else "start: item\n"
        return LLMatcher.grammar_from_lark(start + item + "value: %json " + json.dumps(schema))

    return _checked(make, "JSON schema")


def _checked(make, what: str) -> str:
    """The grammar `make` returns, validated: StructureError saying why the `what` cannot be used otherwise."""
    try:
        grammar = make()
    except (TypeError, ValueError) as exc:
        raise StructureError(f"The {what} cannot be used: {exc}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise StructureError(f"The {what} cannot be used: {_reason(error)}")
    return grammar


def _text_grammar(key: str, data: dict[str, Any]) -> str:
    """The grammar of a regex, a choice or a Lark grammar: the whole answer."""
    what = Structure.from_json(data).what
    if len(key) > MAX_SCHEMA_BYTES:
        raise StructureError(f"The {what} is longer than {MAX_SCHEMA_BYTES // 1024} KiB; send a smaller one.")
    texts = data.get("choice")
    if texts is not None and (not texts or not all(isinstance(t, str) and t for t in texts)):
        raise StructureError("The choice must be a list of one or more non-empty texts.")

    def make() -> str:
        if data.get("regex") is not None:
            return LLMatcher.grammar_from_regex(data["regex"])
        if texts is not None:
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(t, ensure_ascii=False) for t in texts))
        return LLMatcher.grammar_from_lark(data["lark"])

    return _checked(make, what)


def _lazy(begin: str, end: str, repeat: bool, schema: dict[str, Any]) -> str:
    """Lark for free text around values opened by `begin`: TEXT never holds the trigger (begin's non-blank start),
    and LEAD is text ending in `begin`, so the lexer knows a value has begun the moment `begin` is complete."""
    trigger = begin.rstrip()
    if not trigger:
        raise StructureError("A lazy structure needs a 'begin' text that starts it.")
    calls = "(LEAD item)+ TEXT?" if repeat else "LEAD item TEXT?"
    return (f"start: TEXT | {calls}\n"
            f"item: value {json.dumps(end)}\n"
            f"value: %json {json.dumps(schema)}\n"
            f"TEXT: /(.|\\n)*/ & ~(/(.|\\n)*/ {json.dumps(trigger)} /(.|\\n)*/)\n"
            f"LEAD: TEXT {json.dumps(begin)}\n")


def _reason(message: str) -> str:
    """llguidance's message without its excerpts of the generated grammar text, on one line."""
    kept = [line.strip() for line in message.splitlines()
            if line.strip() and not re.match(r"^\s*(\d+\s*\||\^)", line)]
    reason = re.sub(r"^(at \d+\(\d+\): )?(failed to compile JSON schema: )?", "", " ".join(kept))
    return reason if len(reason) <= 300 else reason[:297] + "..."
