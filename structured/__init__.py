"""Structured output: the shape an answer must take, as a grammar the web app checks and the engine enforces."""

from .grammar import MAX_SCHEMA_BYTES, Structure, StructureError

__all__ = ["MAX_SCHEMA_BYTES", "Structure", "StructureError"]
