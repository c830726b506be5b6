"""The order-status tool: one order, read by its exact number; what the model gets back, never an exception."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models import Order

NO_SUCH_ORDER = "no such order"


def lookup_order(db: Session, arguments: dict[str, Any]) -> dict[str, Any]:
    """The order's status, items and shipping (not the customer's name or address: anyone may type a number)."""
    number = arguments.get("order_number")
    if not isinstance(number, str) or not number.strip():
        return {"error": "invalid arguments", "message": "Give the order number as a string, like NW-10042."}
    number = number.strip().lstrip("#").upper()
    order = db.scalars(select(Order).where(Order.order_number == number)).one_or_none()
    if order is None:
        return {"error": NO_SUCH_ORDER, "order_number": number,
                "message": f"There is no order {number}; ask the customer to check the number (like NW-10042, "
                           "in the order confirmation email)."}
    return details(order)


def details(order: Order) -> dict[str, Any]:
    """What the model may know of an order: status, items, shipping, dates; never who placed it."""
    return {"order_number": order.order_number, "status": order.status, "items": order.items,
            "carrier": order.carrier, "tracking_number": order.tracking_number,
            "placed": order.placed_at.date().isoformat(), "updated": order.updated_at.date().isoformat()}
