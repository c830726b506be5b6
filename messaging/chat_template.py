"""A chat template rendered as transformers' `apply_chat_template` renders it (transformers/utils/
chat_template_utils.py), with jinja2 alone: no torch, no transformers."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from messaging.prompts import cut_at_tag, tag_final

__all__ = ["TemplateError", "render"]


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's tokens with it): its body, as
    it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _Dict:
    """`dict(...)` in a template, without the type's attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` refusing underscore-prefixed attributes, as transformers' does."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got "
                                f"{name!r}.")


@lru_cache(maxsize=16)
def compiled(source: str) -> jinja2.Template:
    """The template, compiled once per source; TemplateSyntaxError (a TemplateError) if it is not Jinja."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env.from_string(source)


def render(source: str, messages: list[dict], special_tokens: dict[str, str], tools: list[dict] | None = None,
           add_generation_prompt: bool = True, continue_final_message: bool = False,
           extra: dict[str, Any] | None = None) -> str:
    """The prompt's text; TemplateError when the template refuses the messages (`raise_exception`) or fails on them.

    As transformers: keys whose value is None are dropped from each message, the special tokens (bos_token,
    eos_token, ...) and `extra` (a client's chat_template_kwargs) are the template's variables too, and
    `continue_final_message` cuts the text after the final message's content."""
    chat: list[dict[str, Any]] = [{k: v for k, v in m.items() if v is not None} for m in messages]
    if continue_final_message:
        chat = tag_final(chat)
    text = compiled(source).render(messages=chat, tools=tools, documents=None,
                                   add_generation_prompt=add_generation_prompt, **{**special_tokens, **(extra or {})})
    return cut_at_tag(text) if continue_final_message else text
