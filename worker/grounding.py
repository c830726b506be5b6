"""Grounded answers: before the model writes, the orders a customer's message names and the help articles it asks
about are looked up, and the results join the conversation as tool calls with their results; with
CHAT_GROUNDING=lead the answer also starts with them in a fixed sentence the model continues."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from messaging.chat_tools import LOOKUP_ORDER, stored_call
from messaging.grounding import Grounding, emails, order_numbers
from models import Order
from models.help_articles import WORD, HelpArticle, query_words, search
from worker.order_tool import NO_SUCH_ORDER, details, lookup_order

# Orders looked up per message: a message naming more gets the first ones and is told so.
MAX_ORDERS = 3
# The recorded calls beside lookup_order (never offered to the model: the worker makes them).
FIND_BY_EMAIL, SEARCH_HELP = "find_orders_by_email", "search_help_centre"
NOT_YOURS, NO_ARTICLE, TOO_MANY = "no such order for this email", "no article", "too many order numbers"
INSTRUCTION = ("Answer from the lookups' results below and nothing else: give the status an order lookup returns; "
               "if a result says an order was not found, tell the customer; never give details of any other order.")
# What an order number looks like, as the answers that ask for one show it.
EXAMPLE_NUMBER = "NW-10042"
# Small talk: a message whose words past the help centre's stop words are all of these asks nothing to look up. It
# gets the worker's own reply, as a lead: a small model left to answer a greeting alone wanders, sometimes into a
# loop (a 256-token "customer support AI customer support ..." seen on the default model).
HELLO = frozenset("hello hi hey hiya howdy greetings morning afternoon evening yo".split())   # answered "Hello!"
GREETINGS = HELLO | {"good", "day"}
THANKS = frozenset("thanks thank thx ty cheers bye goodbye".split())
CLOSINGS = frozenset("great perfect awesome cool nice lovely wonderful helpful appreciate appreciated needed "
                     "all see later have".split())
# An order asked about without its number or e-mail ("Where is my order?", "Can you track my parcel?"): the reply
# asks for them. A message of these words (and small talk's) that names one of ORDER_NOUNS.
ORDER_NOUNS = frozenset("order orders parcel parcels package packages shipment".split())
ORDER_WORDS = ORDER_NOUNS | frozenset("track tracking status arrived arrive come coming yet shipped sent".split())
# A person asked for ("I want to talk to a human"): the reply says how to reach one (SUPPORT_CONTACT).
PERSON_NOUNS = frozenset("human person agent someone somebody staff representative people operator manager phone "
                         "contact".split())
PERSON_WORDS = PERSON_NOUNS | frozenset("talk speak reach real live call chat".split())
# Help articles whose titles small talk names as what the assistant can answer.
MAX_TOPICS = 8
STATUS_WORDS = {"processing": "is being processed and has not shipped yet", "shipped": "has shipped",
                "out_for_delivery": "is out for delivery", "delivered": "was delivered",
                "cancelled": "was cancelled", "returned": "was returned"}


@dataclass
class Lookup:
    name: str
    arguments: dict[str, Any]
    result: dict[str, Any]
    lead: str   # the result as a sentence for the customer
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")

    @property
    def result_text(self) -> str:
        return json.dumps(self.result, ensure_ascii=False, separators=(",", ":"))


@dataclass
class Grounded:
    lookups: list[Lookup]
    reply: str = ""   # small talk's answer, which looks nothing up (the lead when there are no lookups)

    @property
    def lead(self) -> str:
        return " ".join(lk.lead for lk in self.lookups if lk.lead) or self.reply

    def messages(self, messages: list[dict]) -> list[dict]:
        """The conversation with the lookups after the customer's message (an instruction added to the system
        prompt), as the model's prompt holds them."""
        if not self.lookups:
            return list(messages)
        out = list(messages)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{INSTRUCTION}"}
        out.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": lk.call_id, "type": "function",
             "function": {"name": lk.name, "arguments": json.dumps(lk.arguments, ensure_ascii=False)}}
            for lk in self.lookups]})
        out += [{"role": "tool", "tool_call_id": lk.call_id, "content": lk.result_text} for lk in self.lookups]
        return out

    def stored(self) -> list[tuple[str, str]]:
        """The lookups as the conversation stores them: each call, then each result."""
        calls = [("tool_call", stored_call(lk.call_id, lk.name, json.dumps(lk.arguments, ensure_ascii=False)))
                 for lk in self.lookups]
        return calls + [("tool", lk.result_text) for lk in self.lookups]


def order_sentence(result: dict[str, Any]) -> str:
    status = result["status"]
    text = f"Order {result['order_number']} {STATUS_WORDS.get(status, 'is ' + status.replace('_', ' '))}"
    text += f" (status: {status.replace('_', ' ')}): {result['items']}."
    if result.get("carrier") and status in ("shipped", "out_for_delivery", "delivered", "returned"):
        text += f" Carrier: {result['carrier']}, tracking number {result['tracking_number']}."
    return text


def customer(messages: list[dict]) -> tuple[str, list[str]]:
    """The customer's newest message and every e-mail address the conversation's customer turns name, in order."""
    turns = [m.get("content") or "" for m in messages if m.get("role") == "user"]
    return (turns[-1] if turns else ""), emails("\n".join(turns))


def by_number(db: Session, number: str, owner: str | None) -> Lookup:
    """One order by its number; with an e-mail in the conversation, only an order placed with that e-mail."""
    arguments = {"order_number": number}
    result = lookup_order(db, arguments)
    if result.get("error") == NO_SUCH_ORDER:
        return Lookup(LOOKUP_ORDER, arguments, result,
                      f"I could not find an order {number}; please check the number in your order confirmation "
                      f"e-mail (it looks like {EXAMPLE_NUMBER}).")
    if owner is not None:
        arguments = {**arguments, "email": owner}
        email = db.scalar(select(Order.customer_email).where(Order.order_number == number))
        if (email or "").lower() != owner:
            # Said the same way as an unknown number: nothing tells whether the number exists.
            return Lookup(LOOKUP_ORDER, arguments,
                          {"error": NOT_YOURS, "order_number": number, "email": owner,
                           "message": f"There is no order {number} for {owner}; ask the customer to check both."},
                          f"I could not find an order {number} for {owner}; please check the number and the "
                          "e-mail address.")
    return Lookup(LOOKUP_ORDER, arguments, result, order_sentence(result))


def by_email(db: Session, email: str) -> Lookup:
    """The latest orders placed with an e-mail address (at most MAX_ORDERS)."""
    orders = db.scalars(select(Order).where(func.lower(Order.customer_email) == email)
                        .order_by(Order.placed_at.desc(), Order.id.desc()).limit(MAX_ORDERS)).all()
    arguments = {"email": email}
    if not orders:
        return Lookup(FIND_BY_EMAIL, arguments,
                      {"error": NO_SUCH_ORDER, "email": email,
                       "message": f"There is no order for {email}; ask for the order number."},
                      f"I could not find any order for {email}; please check the address, or give me the order "
                      f"number (it looks like {EXAMPLE_NUMBER}).")
    found = [details(o) for o in orders]
    return Lookup(FIND_BY_EMAIL, arguments, {"email": email, "orders": found},
                  " ".join(order_sentence(r) for r in found))


def help_lookup(db: Session, question: str, contact: str) -> Lookup:
    """The best help article for a question; when none matches, a result saying so and how to reach a person (a
    message with no word to search is small talk's, answered before this)."""
    arguments = {"query": question[:200]}
    found = search(db, question, limit=1)
    if found:
        a = found[0].article
        return Lookup(SEARCH_HELP, arguments,
                      {"article": a.title, "slug": a.slug, "summary": a.summary, "text": a.body},
                      f'From our help centre article "{a.title}": {a.summary}')
    return Lookup(SEARCH_HELP, arguments,
                  {"error": NO_ARTICLE, "message": "No help article covers this. Say you do not know and how to "
                                                   f"reach a person: {contact}."},
                  f"I'm sorry, I don't know the answer to that, and I would rather not guess. To reach a person, "
                  f"{contact}.")


def small_talk(db: Session, text: str, contact: str) -> str | None:
    """The reply to a message that asks nothing to look up: a greeting, "can you help me?" (what the assistant can
    help with, the help centre's articles named), a thank-you or goodbye, an order asked about without its number
    or e-mail (asked for them), a person asked for (how to reach one). None for a message with something to look
    up."""
    words = set(WORD.findall(text.lower()))
    asked = set(query_words(text)) - GREETINGS - THANKS - CLOSINGS
    hello = "Hello! " if words & HELLO else ""
    if asked <= ORDER_WORDS and words & ORDER_NOUNS:
        return (f"{hello}I can look that up: give me the order number (it looks like {EXAMPLE_NUMBER}) or the e-mail "
                "address you ordered with.")
    if asked <= PERSON_WORDS and words & PERSON_NOUNS:
        return f"{hello}To reach a person, {contact}."
    if asked:
        return None
    if words & THANKS:
        return "You're welcome! If anything else comes up, just ask."
    titles = db.scalars(select(HelpArticle.title).order_by(HelpArticle.id).limit(MAX_TOPICS + 1)).all()
    topics = [t[:1].lower() + t[1:] if t[1:2].islower() else t for t in titles]
    if len(topics) > MAX_TOPICS:
        topics[MAX_TOPICS:] = ["more"]
    offer = (f"I can look up your orders (give me the order number, like {EXAMPLE_NUMBER}, or the e-mail address you "
             "ordered with)")
    if topics:
        offer += " and answer questions about " + (", ".join(topics[:-1]) + " and " if len(topics) > 1 else "") + \
            topics[-1]
    return hello + offer + ". What can I do for you?"


def ground(db: Session, messages: list[dict], settings: Grounding) -> Grounded:
    """The lookups a conversation's newest message calls for: its order numbers (the first MAX_ORDERS), else the
    orders of the e-mail it gives; without either, small talk's reply (no lookup), else the help article it asks
    about, or a "no article" result."""
    text, addresses = customer(messages)
    owner = addresses[0] if addresses else None   # the conversation's customer: the first address they gave
    lookups: list[Lookup] = []
    for other in [a for a in emails(text) if a != owner]:
        lookups.append(Lookup(FIND_BY_EMAIL, {"email": other},
                              {"error": NOT_YOURS, "email": other, "message": "Orders are shown only for the "
                               f"e-mail address this conversation gave first ({owner})."},
                              f"I can only help with the orders of the e-mail address you gave first ({owner})."))
    numbers = order_numbers(text, settings.order_pattern)
    lookups += [by_number(db, n, owner) for n in numbers[:MAX_ORDERS]]
    if len(numbers) > MAX_ORDERS:
        rest = numbers[MAX_ORDERS:]
        lookups.append(Lookup(LOOKUP_ORDER, {"order_numbers": rest},
                              {"error": TOO_MANY, "message": f"Only {MAX_ORDERS} orders are looked up per "
                               f"message; {len(rest)} more were not."},
                              f"I look up at most {MAX_ORDERS} orders per message; please ask about the other "
                              f"{len(rest)} in another message."))
    if not numbers and owner is not None and owner in emails(text):
        lookups.append(by_email(db, owner))
    if lookups:   # a message about orders gets their facts alone: an article beside them confuses a small model
        return Grounded(lookups)
    reply = small_talk(db, text, settings.contact)
    if reply is not None:
        return Grounded([], reply)
    return Grounded([help_lookup(db, text, settings.contact)])
