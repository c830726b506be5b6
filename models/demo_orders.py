"""Demo orders for the order-status tool: `python -m models.demo_orders` adds those missing, and `make run` does on
its embedded SQLite database unless DEMO_ORDERS=0."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from models.base import utcnow
from models.orders import Order


@dataclass(frozen=True)
class DemoOrder:
    order_number: str
    customer_name: str
    customer_email: str
    status: str
    items: str
    carrier: str | None
    tracking_number: str | None
    placed_days_ago: int
    updated_days_ago: int


DEMO_ORDERS = (
    DemoOrder("NW-10041", "Ada Lovelace", "ada@example.com", "processing", "1 x Blue enamel teapot",
              None, None, 1, 1),
    DemoOrder("NW-10042", "Grace Hopper", "grace@example.com", "shipped", "2 x Stoneware mug, 1 x Tea towel",
              "DHL", "JD014600003828", 4, 2),
    DemoOrder("NW-10043", "Alan Turing", "alan@example.com", "out_for_delivery", "1 x Walnut chopping board",
              "UPS", "1Z999AA10123456784", 5, 0),
    DemoOrder("NW-10044", "Katherine Johnson", "katherine@example.com", "delivered", "3 x Linen napkin",
              "Royal Mail", "RM123456785GB", 12, 6),
    DemoOrder("NW-10045", "Edsger Dijkstra", "edsger@example.com", "cancelled", "1 x Cast-iron skillet",
              None, None, 9, 8),
    DemoOrder("NW-10046", "Barbara Liskov", "barbara@example.com", "returned", "1 x Wool throw (grey)",
              "DPD", "15501234567890", 30, 3),
)


def seed(db: Session, now: datetime | None = None) -> int:
    """Add the demo orders whose numbers are not taken (orders already there are left as they are); returns how
    many were added. Safe to run any number of times, by several processes at once."""
    now = now or utcnow()
    taken = set(db.scalars(select(Order.order_number).where(
        Order.order_number.in_([d.order_number for d in DEMO_ORDERS]))))
    added = 0
    for demo in DEMO_ORDERS:
        if demo.order_number in taken:
            continue
        db.add(Order(order_number=demo.order_number, customer_name=demo.customer_name,
                     customer_email=demo.customer_email, status=demo.status, items=demo.items,
                     carrier=demo.carrier, tracking_number=demo.tracking_number,
                     placed_at=now - timedelta(days=demo.placed_days_ago),
                     updated_at=now - timedelta(days=demo.updated_days_ago)))
        added += 1
    try:
        db.commit()
    except IntegrityError:   # another process seeded at the same moment: its rows are the same
        db.rollback()
        return 0
    return added


def wanted(database_url_given: bool) -> bool:
    """DEMO_ORDERS=1 seeds, 0 does not; unset, only the embedded default database (no DATABASE_URL given) is
    seeded, never a deployment's."""
    value = os.environ.get("DEMO_ORDERS", "").strip().lower()
    if not value:
        return not database_url_given
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"DEMO_ORDERS must be 1 or 0; got {value!r}. Fix it in the environment (or .env), or unset it.")


def seed_url(database_url: str | None = None) -> int:
    from models.db import make_engine, make_session_factory

    engine = make_engine(database_url)
    try:
        with make_session_factory(engine)() as db:
            return seed(db)
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m models.demo_orders",
                            description="Add the demo orders (NW-10041 to NW-10046) that are missing from the "
                                        "database at DATABASE_URL.").parse_args(argv)
    added = seed_url()
    print(f"demo orders: {added} added, {len(DEMO_ORDERS) - added} already there")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
