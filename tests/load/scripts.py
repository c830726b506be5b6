"""Built-in customer scripts: short support conversations whose later turns follow up on earlier ones."""

from __future__ import annotations

import random
from dataclasses import dataclass

ITEMS = ("rain jacket", "wool sweater", "running shoes", "linen shirt", "denim jeans", "winter boots")
SIZES = ("XS", "S", "M", "L", "XL", "38", "42")
COUNTRIES = ("Canada", "Norway", "Japan", "Australia", "Mexico", "Switzerland")


@dataclass(frozen=True)
class Script:
    name: str
    turns: tuple[str, ...]

    def render(self, rng: random.Random) -> list[str]:
        """The turns with this customer's own order number, item, size and country filled in."""
        values = {"order": rng.randint(100000, 999999), "item": rng.choice(ITEMS), "size": rng.choice(SIZES),
                  "country": rng.choice(COUNTRIES)}
        return [turn.format(**values) for turn in self.turns]


SCRIPTS: tuple[Script, ...] = (
    Script("order_status", (
        "Hi, where is my order #{order}? It was supposed to arrive yesterday.",
        "The tracking page has not changed for three days. Could it be lost?",
        "If it does not show up by Friday, can you send a replacement instead?",
    )),
    Script("return", (
        "I'd like to return the {item} I bought last week; it doesn't fit.",
        "It's unworn and still has the tags on. Do I have to pay for the return label?",
        "How long until the refund shows up on my card?",
        "Could I exchange it for a size {size} instead of getting a refund?",
    )),
    Script("shipping_abroad", (
        "Do you ship to {country}?",
        "How long does delivery take there, and will I have to pay customs fees?",
    )),
    Script("sizes", (
        "I usually wear a {size}. Which size should I order in your {item}?",
        "Does it shrink after washing?",
        "And if it is still too small, can I swap it for the next size up?",
    )),
    Script("payment_failed", (
        "My card was declined at checkout, but I think the money was taken anyway.",
        "It's a Visa debit card. Will the charge disappear on its own?",
        "Can I pay with PayPal instead?",
    )),
    Script("change_address", (
        "Can I change the delivery address for order #{order}?",
        "I moved last week; the new address is 12 Harbour Street, Leeds LS1 4AB.",
    )),
    Script("damaged", (
        "My {item} arrived damaged; the box was completely crushed.",
        "I have photos of it. Where should I send them?",
        "Would you rather refund me or send a new one?",
    )),
    Script("discount_code", (
        "My discount code SPRING15 isn't working at checkout.",
        "It says expired, but the email said it's valid until the end of the month.",
    )),
    Script("cancel_order", (
        "Please cancel order #{order}; I ordered the wrong colour.",
    )),
    Script("store", (
        "Do you have a physical store where I can try things on before buying?",
    )),
)


def pick(rng: random.Random) -> tuple[Script, list[str]]:
    script = rng.choice(SCRIPTS)
    return script, script.render(rng)
