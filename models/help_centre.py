"""The help centre for operators: `python -m models.help_centre list`, `show SLUG`, `search QUESTION`,
`add SLUG --title ... --summary ... --body ...`, `edit SLUG [--title/--summary/--body/--keywords ...]`,
`remove SLUG`, `seed` (the demo set's missing articles; `make run` does it where it seeds the demo orders).
Text options read a file with @path. The database is DATABASE_URL's (default: instance/supportbot.db)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from models.help_articles import HelpArticle, search

CLI = "python -m models.help_centre"
SLUG = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
LIMITS = {"title": 200, "summary": 500, "keywords": 500, "body": 20000}


@dataclass(frozen=True)
class DemoArticle:
    slug: str
    title: str
    summary: str
    body: str
    keywords: str


DEMO_ARTICLES = (
    DemoArticle(
        "returns", "Returns and exchanges",
        "Unused items can be returned within 30 days of delivery for a full refund, and return shipping is free.",
        "Start a return from the link in your delivery e-mail or by giving us your order number; we send a prepaid "
        "return label. Items must be unused and in their original packaging. Exchanges for another size or colour "
        "are sent once the return is scanned by the carrier. Sale items can be returned too; gift cards cannot.",
        "return exchange send back wrong size unwanted label"),
    DemoArticle(
        "refunds", "Refunds",
        "Refunds go back to the original payment method within 5 business days of your return reaching our "
        "warehouse.",
        "We e-mail you when the refund is issued. Your bank may take a few more days to show it. Shipping costs are "
        "refunded when the item was faulty or we sent the wrong one. A cancelled order that had not shipped is "
        "refunded in full at once.",
        "refund money back reimburse credit"),
    DemoArticle(
        "shipping", "Shipping and delivery times",
        "Orders ship within 2 business days; standard delivery takes 3-7 business days and is free over $50, and "
        "express delivery takes 1-2 business days for $9.95.",
        "We ship with DHL, UPS, Royal Mail and DPD, and e-mail a tracking number when the parcel leaves. Standard "
        "delivery costs $4.95 below $50. We ship to the UK, the EU and the US; customs duties outside the EU are "
        "included in the price.",
        "shipping delivery deliver ship arrive arrival late tracking express standard cost countries"),
    DemoArticle(
        "delivery-changes", "Changing a delivery address or date",
        "You can change the delivery address until the order ships; after that, use the carrier's tracking page to "
        "pick another day or a pickup point.",
        "Send us the order number and the new address before the order ships and we update it. Once the parcel has "
        "left, the carrier's tracking link lets you choose another delivery day, a neighbour or a pickup point. If "
        "you miss a delivery the carrier tries again the next business day.",
        "change address wrong address move redirect reschedule missed pickup point"),
    DemoArticle(
        "damaged-items", "Damaged or wrong items",
        "If an item arrives damaged or faulty, or is not what you ordered, tell us within 14 days of delivery and we "
        "send a replacement or refund it in full, shipping included.",
        "Send us your order number and a photo of the item and its packaging. There is no need to send a broken "
        "item back unless we ask for it; for a wrong item we send a prepaid return label. Replacements ship as soon "
        "as we have your message, and a refund goes back to the original payment method.",
        "damaged broken faulty defective cracked chipped smashed scratched wrong missing replacement replace"),
    DemoArticle(
        "payment", "Payment methods",
        "We accept Visa, Mastercard, American Express, PayPal and Apple Pay; your card is charged when the order "
        "ships.",
        "Prices include VAT. If a payment fails, the order waits 48 hours for another try before it is cancelled. "
        "We never ask for card details in the chat or by e-mail.",
        "pay payment card credit debit paypal apple charge charged invoice vat declined failed"),
    DemoArticle(
        "cancelling", "Cancelling an order",
        "An order can be cancelled free of charge until it ships; once it has shipped, send it back as a return.",
        "Ask us with your order number and we cancel it before it leaves the warehouse; your card is not charged "
        "for a cancelled order. Orders placed with express delivery often ship the same day, so ask soon.",
        "cancel cancellation cancelled stop mistake mind"),
    DemoArticle(
        "gift-cards", "Gift cards",
        "Gift cards from $10 to $200 are sent by e-mail and can be used for anything in the shop for 3 years.",
        "Buy them in the shop like any item. A gift card pays for part or all of an order, the rest with another "
        "payment method. Gift cards cannot be returned or exchanged for cash; a lost gift card e-mail is sent again "
        "on request.",
        "gift voucher present code balance"),
    DemoArticle(
        "warranty", "Warranty",
        "Every item has a 2-year warranty against manufacturing faults, counted from the day it was delivered.",
        "Tell us what went wrong with your order number and a photo; we repair or replace the item, or refund it "
        "when neither is possible. Wear and tear and accidental damage are not covered.",
        "warranty guarantee stopped working fault years"),
)


def seed(db: Session) -> int:
    """Add the demo articles whose slugs are not taken (articles already there are left as they are); returns how
    many were added."""
    taken = set(db.scalars(select(HelpArticle.slug)))
    added = [HelpArticle(slug=a.slug, title=a.title, summary=a.summary, body=a.body, keywords=a.keywords)
             for a in DEMO_ARTICLES if a.slug not in taken]
    db.add_all(added)
    try:
        db.commit()
    except IntegrityError:   # another process seeded at the same moment: its rows are the same
        db.rollback()
        return 0
    return len(added)


def seed_url(database_url: str | None = None) -> int:
    from models.db import make_engine, make_session_factory

    engine = make_engine(database_url)
    try:
        with make_session_factory(engine)() as db:
            return seed(db)
    finally:
        engine.dispose()


class ArticleError(Exception):
    """An operator's request that cannot be done as asked; the message says what to do instead."""


def find(db: Session, slug: str) -> HelpArticle:
    article = db.scalar(select(HelpArticle).where(HelpArticle.slug == slug))
    if article is None:
        raise ArticleError(f"No article has the slug {slug!r}; `{CLI} list` shows them.")
    return article


def checked(fields: dict[str, str | None]) -> dict[str, str]:
    """The given fields, trimmed, each within its length; an empty title, summary or body is refused."""
    out = {}
    for name, value in fields.items():
        if value is None:
            continue
        value = value.strip()
        if not value and name != "keywords":
            raise ArticleError(f"--{name} may not be empty.")
        if len(value) > LIMITS[name]:
            raise ArticleError(f"--{name} has {len(value)} characters; at most {LIMITS[name]} fit.")
        out[name] = value
    return out


def add(db: Session, slug: str, title: str, summary: str, body: str, keywords: str = "") -> HelpArticle:
    if not SLUG.match(slug):
        raise ArticleError(f"{slug[:80]!r} is not a usable slug: 1 to 64 lower-case letters, digits or '-', "
                           "starting with a letter or digit (e.g. gift-cards).")
    if db.scalar(select(HelpArticle).where(HelpArticle.slug == slug)) is not None:
        raise ArticleError(f"An article {slug!r} exists already; change it with `{CLI} edit {slug} ...`.")
    article = HelpArticle(slug=slug, **checked({"title": title, "summary": summary, "body": body,
                                                  "keywords": keywords}))
    db.add(article)
    db.commit()
    return article


def edit(db: Session, slug: str, **fields: str | None) -> HelpArticle:
    changes = checked(fields)
    if not changes:
        raise ArticleError("Nothing to change: give --title, --summary, --body or --keywords.")
    article = find(db, slug)
    for name, value in changes.items():
        setattr(article, name, value)
    db.commit()
    return article


def remove(db: Session, slug: str) -> None:
    db.delete(find(db, slug))
    db.commit()


def text_arg(value: str | None) -> str | None:
    """An option's text, or a file's when it starts with @."""
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise ArticleError(f"Cannot read {value[1:]!r}: {exc.strerror}.") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=CLI, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every article: slug, title, last change")
    sub.add_parser("show", help="one article in full").add_argument("slug")
    sub.add_parser("search", help="the articles the assistant would use for a question").add_argument("question")
    for name in ("add", "edit"):
        cmd = sub.add_parser(name, help=f"{name} an article (text options: @file reads a file)")
        cmd.add_argument("slug")
        for field in ("title", "summary", "body", "keywords"):
            cmd.add_argument(f"--{field}", required=name == "add" and field != "keywords")
    sub.add_parser("remove", help="delete an article").add_argument("slug")
    sub.add_parser("seed", help="add the demo articles that are missing")
    return p


def run(db: Session, args: argparse.Namespace) -> str:
    if args.command == "list":
        rows = db.scalars(select(HelpArticle).order_by(HelpArticle.slug)).all()
        return "\n".join(f"{a.slug:<20} {a.title:<40} {a.updated_at:%Y-%m-%d %H:%M}" for a in rows) or \
            f"No articles yet: `{CLI} seed` adds the demo set, `{CLI} add` your own."
    if args.command == "show":
        a = find(db, args.slug)
        return f"{a.title} ({a.slug})\n\n{a.summary}\n\n{a.body}\n\nkeywords: {a.keywords}"
    if args.command == "search":
        found = search(db, args.question, limit=3)
        return "\n".join(f"{f.score:8.3f}  {f.article.slug}: {f.article.title}" for f in found) or \
            "No article matches; the assistant would say it does not know and how to reach a person."
    if args.command == "seed":
        added = seed(db)
        return f"demo articles: {added} added, {len(DEMO_ARTICLES) - added} already there or replaced by yours"
    if args.command == "remove":
        remove(db, args.slug)
        return f"removed {args.slug}"
    fields = {f: text_arg(getattr(args, f)) for f in ("title", "summary", "body", "keywords")}
    if args.command == "add":
        a = add(db, args.slug, fields["title"], fields["summary"], fields["body"], fields["keywords"] or "")
        return f"added {a.slug}: {a.title}"
    a = edit(db, args.slug, **fields)
    return f"changed {a.slug}: {a.title}"


def main(argv: Sequence[str] | None = None) -> int:
    from models.db import make_engine, make_session_factory

    args = parser().parse_args(argv)
    engine = make_engine()
    try:
        with make_session_factory(engine)() as db:
            print(run(db, args))
        return 0
    except ArticleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SQLAlchemyError as exc:
        print(f"error: the database cannot be used ({type(exc).__name__}): run the migrations first "
              "(`make run` does, or `python -m alembic upgrade head`) and check DATABASE_URL.", file=sys.stderr)
        return 1
    finally:
        engine.dispose()


if __name__ == "__main__":
    raise SystemExit(main())
