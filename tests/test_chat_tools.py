"""The chat assistant's order-status tool through the whole stack: a forced call on the tiny model, run by the
worker against the orders table, its result fed back, the answer streamed and the exchange stored."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import delete

from messaging import chat_tools
from models import Message, Order, RequestRecord, demo_orders
from tests.clients import ChatClient
from webapp.config import system_prompt
from worker import prompts
from worker.order_tool import NO_SUCH_ORDER

QUESTION = "Where is my order? It has not arrived yet."


@pytest.fixture(scope="module")
def tools_web(stack):
    """A web process whose assistant must look an order up before it answers (the tiny model calls no tool by
    itself); no grounded lookups, so the model's own call is the only one."""
    return stack.web_with(CHAT_TOOLS="orders", CHAT_TOOL_CHOICE="lookup_order", CHAT_GROUNDING="off")


def ask(url: str, text: str, client: ChatClient | None = None, conversation_id: str | None = None) -> dict:
    own = client is None
    client = client or ChatClient(url)
    try:
        result = client.ask(text, conversation_id=conversation_id, timeout=120)
    finally:
        if own:
            client.close()
    done = result["done"]
    assert "".join(result["tokens"]) == done["text"] and done["finish_reason"] in ("stop", "length")
    return done


def exchange(db, done: dict) -> tuple[dict, dict, list[Message]]:
    """The stored call and result behind an answer, and the conversation's messages."""
    with db() as s:
        messages = s.query(Message).filter_by(conversation_id=done["conversation_id"]).order_by(Message.id).all()
    roles = [m.role for m in messages]
    assert roles[-4:] == ["user", "tool_call", "tool", "assistant"], roles
    assert messages[-1].request_id == done["request_id"] and messages[-1].content == done["text"]
    return json.loads(messages[-3].content), json.loads(messages[-2].content), messages


def test_the_worker_looks_the_order_up_feeds_the_result_back_and_stores_the_exchange(stack, tools_web, db,
                                                                                      tokenizer):
    with db() as s:
        demo_orders.seed(s)
    unknown = ask(tools_web, QUESTION)
    call, result, _ = exchange(db, unknown)
    assert call["name"] == chat_tools.LOOKUP_ORDER
    number = json.loads(call["arguments"])["order_number"].strip().upper()
    # The tiny model's number is whatever its random weights make of it: not one of the shop's orders.
    assert result["error"] == NO_SUCH_ORDER and result["order_number"] == number, result
    assert "check the number" in result["message"]

    # The same question again (greedy, so the same call), now that an order has that number.
    with db() as s:
        s.execute(delete(Order).where(Order.order_number == number))
        s.add(Order(order_number=number, customer_name="Test Customer", customer_email="t@example.com",
                    status="out_for_delivery", items="1 x Copper kettle", carrier="UPS", tracking_number="1Z0042"))
        s.commit()
    client = ChatClient(tools_web)
    try:
        found = ask(tools_web, QUESTION, client)
        call, result, messages = exchange(db, found)
        assert json.loads(call["arguments"])["order_number"].strip().upper() == number
        assert result["order_number"] == number and result["status"] == "out_for_delivery"
        assert result["items"] == "1 x Copper kettle" and result["tracking_number"] == "1Z0042"
        assert "customer_email" not in result and "customer_name" not in result
        # Both generations are counted: the first prompt, and the second with the call and its result in it.
        asked = [{"role": "system", "content": system_prompt("Northwind Goods")}, {"role": "user", "content": QUESTION}]
        answered = [*asked, *chat_tools.history([(m.role, m.content) for m in messages[-3:-1]], with_tools=True)]
        tools = [chat_tools.ORDER_TOOL]
        first_prompt = len(prompts.render(tokenizer, asked, tools))
        assert record_of(db, found).prompt_tokens == found["prompt_tokens"] == \
            first_prompt + len(prompts.render(tokenizer, answered, tools))
        record = record_of(db, found)
        assert record.completion_tokens == found["completion_tokens"] > 10   # the call's tokens too
        assert record.finish_reason == found["finish_reason"]
        assert record.admitted_at <= record.first_token_at <= record.finished_at

        # A follow-up is answered with the exchange in its history (the tiny model's 512-token context then keeps
        # only the newest turns); the page and the conversation's JSON show only the customer's turns.
        follow = ask(tools_web, "Thanks! When will it come?", client, conversation_id=found["conversation_id"])
        assert follow["conversation_id"] == found["conversation_id"]
        shown = client.http.get(f"{tools_web}/conversations/{found['conversation_id']}").json()
        assert [m["role"] for m in shown["messages"]] == ["user", "assistant"] * 2
        page = client.http.get(f"{tools_web}/?c={found['conversation_id']}").text
        assert page.count('data-role="assistant"') == 2 and "tool_response" not in page and number not in page
    finally:
        client.close()
        with db() as s:
            s.execute(delete(Order).where(Order.order_number == number))
            s.commit()



def test_with_auto_a_model_that_calls_no_tool_answers_in_one_generation(stack, db, tokenizer):
    """The default choice: the tool is offered (described in the system prompt for SmolLM2's template), the tiny
    model writes no call, and its text is the answer; nothing but the turns is stored."""
    done = ask(stack.web_with(CHAT_TOOLS="orders", CHAT_GROUNDING="off"), QUESTION)
    with db() as s:
        roles = [m.role for m in s.query(Message).filter_by(conversation_id=done["conversation_id"])
                 .order_by(Message.id)]
    assert roles == ["user", "assistant"] and done["text"]
    asked = [{"role": "system", "content": system_prompt("Northwind Goods")}, {"role": "user", "content": QUESTION}]
    assert done["prompt_tokens"] == len(prompts.render(tokenizer, asked, [chat_tools.ORDER_TOOL]))
    assert record_of(db, done).prompt_tokens == done["prompt_tokens"]

def record_of(db, done: dict) -> RequestRecord:
    with db() as s:
        return s.get(RequestRecord, done["request_id"])


# A Qwen2.5-style template: tools listed in the system turn, calls as objects, results in a tool turn.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0].content if messages[0].role == 'system' else '' }}\n"
    "<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'system' and tools %}"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>{\"name\": "
    "\"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

STORED = [("user", "Where is NW-10042?"),
          ("tool_call", chat_tools.stored_call("call_a", "lookup_order", '{"order_number":"NW-10042"}')),
          ("tool_call", chat_tools.stored_call("call_b", "lookup_order", '{"order_number":"NW-10043"}')),
          ("tool", '{"status":"shipped"}'), ("tool", '{"status":"delivered"}'), ("assistant", "Both are on the way.")]


def test_a_stored_exchange_becomes_chat_messages_again_or_is_left_out_without_tools():
    messages = chat_tools.history(STORED, with_tools=True)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_a", "call_b"]
    assert messages[1]["tool_calls"][1]["function"] == {"name": "lookup_order",
                                                        "arguments": '{"order_number":"NW-10043"}'}
    assert [m["tool_call_id"] for m in messages[2:4]] == ["call_a", "call_b"]
    assert chat_tools.history(STORED, with_tools=False) == [{"role": "user", "content": "Where is NW-10042?"},
                                                            {"role": "assistant", "content": "Both are on the way."}]


def test_tools_render_through_a_template_with_a_tool_format_else_through_the_system_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, *chat_tools.history(STORED[:4], with_tools=True)]
    tools = [chat_tools.ORDER_TOOL]
    assert not prompts.has_tool_format(tokenizer)   # SmolLM2's template has none
    described = tokenizer.decode(prompts.render(tokenizer, messages, tools))
    assert described.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools")
    assert '<tool_call>\n{"name": "lookup_order", "arguments": {"order_number": "NW-10043"}}\n</tool_call>' \
        in described
    assert '<|im_start|>user\n<tool_response>\n{"status":"shipped"}\n</tool_response><|im_end|>' in described
    assert described.endswith("<|im_start|>assistant\n")
    template = tokenizer.chat_template
    tokenizer.chat_template = TOOL_TEMPLATE
    try:
        assert prompts.has_tool_format(tokenizer)
        templated = tokenizer.decode(prompts.render(tokenizer, messages, tools))
    finally:
        tokenizer.chat_template = template
    assert "You can call these tools" not in templated and templated.count('"name": "lookup_order"') == 3
    assert '"arguments": {"order_number": "NW-10042"}' in templated   # an object, not its JSON text
    assert '<|im_start|>tool\n{"status":"shipped"}<|im_end|>' in templated


def test_the_lookup_reads_one_order_by_its_number_and_explains_what_it_cannot_find(tmp_path):
    from models.db import make_engine, make_session_factory, upgrade
    from worker.order_tool import lookup_order

    url = f"sqlite:///{tmp_path / 'orders.db'}"
    upgrade(url)
    engine = make_engine(url)
    try:
        with make_session_factory(engine)() as s:
            demo_orders.seed(s)
            found = lookup_order(s, {"order_number": " nw-10042 "})
            assert found["status"] == "shipped" and found["carrier"] == "DHL" and found["order_number"] == "NW-10042"
            assert set(found) == {"order_number", "status", "items", "carrier", "tracking_number", "placed",
                                  "updated"}
            missing = lookup_order(s, {"order_number": "NW-99999"})
            assert missing["error"] == NO_SUCH_ORDER and "check the number" in missing["message"]
            assert lookup_order(s, {"order_number": 10042})["error"] == "invalid arguments"
            assert lookup_order(s, {})["error"] == "invalid arguments"
    finally:
        engine.dispose()


def test_the_settings_name_known_tools_and_choices_only(monkeypatch):
    from webapp import config

    monkeypatch.setenv("CHAT_TOOLS", "orders")
    monkeypatch.setenv("CHAT_TOOL_CHOICE", "lookup_order")
    assert config.chat_tools_settings() == {"CHAT_TOOLS": [chat_tools.ORDER_TOOL], "CHAT_TOOL_CHOICE": "lookup_order"}
    monkeypatch.setenv("CHAT_TOOL_CHOICE", "lookup_everything")
    with pytest.raises(config.ConfigError, match="Fix it in the environment"):
        config.load()
    monkeypatch.delenv("CHAT_TOOLS")
    monkeypatch.delenv("CHAT_TOOL_CHOICE")
    assert config.chat_tools_settings() == {"CHAT_TOOLS": [], "CHAT_TOOL_CHOICE": "auto"}   # off by default
    assert chat_tools.tools_setting("") == [] and chat_tools.tools_setting("off") == []
    assert chat_tools.tools_setting(" orders ") == [chat_tools.ORDER_TOOL]
    with pytest.raises(ValueError, match="CHAT_TOOLS names 'tickets'; the tools there are orders"):
        chat_tools.tools_setting("orders,tickets")
    tools = chat_tools.tools_setting("orders")
    assert [chat_tools.choice_setting(v, tools) for v in (None, "auto", "required", "lookup_order")] == \
        ["auto", "auto", "required", "lookup_order"]
    with pytest.raises(ValueError, match="CHAT_TOOL_CHOICE must be auto, required or the name of a tool"):
        chat_tools.choice_setting("lookup_everything", tools)
