"""Conversations and their messages."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import ForeignKey, String, Text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from models.base import Base, utcnow

ROLES = ("user", "assistant")


def new_conversation_id() -> str:
    """A random 128-bit id: conversation URLs must not be guessable from one another."""
    return uuid.uuid4().hex


class Conversation(Base):
    """One chat thread, owned by the browser session that started it."""

    __tablename__ = "conversations"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_conversation_id)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    messages: Mapped[list[Message]] = relationship(
        back_populates="conversation",
        order_by="Message.id",
        cascade="all, delete-orphan",
        passive_deletes=True,
    )

    def __repr__(self) -> str:
        return f"Conversation(id={self.id!r}, owner={self.owner!r})"


class Message(Base):
    """One turn of a conversation; `role` is one of `ROLES` (what the customer sees), or `tool_call` / `tool`: a
    tool call the assistant made before its answer, and the result it got (messaging/chat_tools.py)."""

    __tablename__ = "messages"

    id: Mapped[int] = mapped_column(primary_key=True)
    conversation_id: Mapped[str] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)
    # Unique so that a redelivered generation request cannot store a second answer.
    request_id: Mapped[str | None] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    conversation: Mapped[Conversation] = relationship(back_populates="messages")

    def __repr__(self) -> str:
        return f"Message(id={self.id!r}, conversation_id={self.conversation_id!r}, role={self.role!r})"
