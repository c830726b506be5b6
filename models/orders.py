"""Customers' orders, as the chat assistant's order-status tool reads them."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base, utcnow

ORDER_STATUSES = ("processing", "shipped", "out_for_delivery", "delivered", "cancelled", "returned")


class Order(Base):
    """One order: who placed it, what it holds, where it is. Looked up by its number, exactly."""

    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    order_number: Mapped[str] = mapped_column(String(32), unique=True)
    customer_name: Mapped[str] = mapped_column(String(128))
    customer_email: Mapped[str] = mapped_column(String(254))
    status: Mapped[str] = mapped_column(String(32))   # one of ORDER_STATUSES
    items: Mapped[str] = mapped_column(String(500))   # a summary: "1 x Blue teapot, 2 x Stoneware mug"
    carrier: Mapped[str | None] = mapped_column(String(64))
    tracking_number: Mapped[str | None] = mapped_column(String(64))
    placed_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    def __repr__(self) -> str:
        return f"Order(order_number={self.order_number!r}, status={self.status!r})"
