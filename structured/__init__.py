"""Structured output: the shapes an answer must take (JSON schemas, tool calls) and reading tool calls back out."""

from .grammar import MAX_SCHEMA_BYTES, Structure, StructureError
from .tools import StreamParser, Tool, ToolCall, ToolError

__all__ = ["MAX_SCHEMA_BYTES", "StreamParser", "Structure", "StructureError", "Tool", "ToolCall", "ToolError"]
