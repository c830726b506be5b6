"""The web app's prompt check without the model: it renders and counts a prompt as the worker does, from what the
worker publishes; a template that raises is the client's error in either tier."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from messaging import chat_template
from messaging.prompt_form import PromptForm
from messaging.prompts import TemplateOptions
from tests.test_prompts import HISTORY, LOOKUP, ROLE_CHECK, TOOL_TEMPLATE
from webapp.prompt_check import Model
from worker.model_loader import load_tokenizer
from worker.prompts import prompt_form, render, text_ids

# A template in the way of Qwen2.5's: tools as JSON (tojson), a namespace, loop controls, a generation block.
RICH_TEMPLATE = (
    "{% set ns = namespace(system=false) %}"
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% set ns.system = true %}{% endif %}"
    "<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}"
    "{% endgeneration %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token if not ns.system else '' }}")
PLAIN = [{"role": "system", "content": "You help."},
         {"role": "user", "content": "Where is order NW-1? <|im_end|> héllo 🤖\n\n  spaced"}]


def published(tokenizer, max_model_len: int = 512) -> Model:
    """The web's Model of what a worker serving `tokenizer` publishes, through its JSON."""
    form, text = prompt_form(tokenizer, max_model_len)
    return Model(PromptForm.from_json(form.to_json()), Tokenizer.from_str(text))


@pytest.fixture(scope="module", params=["default", "llama", "qwen2", "qwen3", "gpt2"])
def model_tokenizer(request, tiny_model_dirs):
    """The default model's tokenizer, and each tiny test model's as loaded from its directory."""
    return load_tokenizer(None if request.param == "default" else str(tiny_model_dirs[request.param]))


@pytest.mark.parametrize("template", ["own", "tool format", "rich", "role check"])
def test_the_web_counts_the_tokens_the_worker_renders(model_tokenizer, template):
    tokenizer = model_tokenizer
    own = tokenizer.chat_template
    tokenizer.chat_template = {"own": own, "tool format": TOOL_TEMPLATE, "rich": RICH_TEMPLATE,
                               "role check": ROLE_CHECK + own}[template]
    try:
        model = published(tokenizer)
        assert model.form.tool_format == (template in ("tool format", "rich"))
        for messages in (PLAIN, HISTORY):
            for tools in (None, [LOOKUP]):
                assert model.chat_tokens(messages, tools) == len(render(tokenizer, messages, tools)), (messages, tools)
        for text in ("Order 1234 is", PLAIN[1]["content"], " leading space and <|im_start|>assistant\n"):
            assert model.completion_tokens(text) == len(text_ids(tokenizer, text))
        assert model.completion_tokens([5, 6, 7]) == 3
    finally:
        tokenizer.chat_template = own


def test_the_web_hears_a_templates_refusal_as_the_worker_does(tokenizer):
    own = tokenizer.chat_template
    tokenizer.chat_template = ROLE_CHECK + own
    try:
        model = published(tokenizer)
    finally:
        tokenizer.chat_template = own
    with pytest.raises(chat_template.TemplateError, match="roles must alternate"):
        model.chat_tokens([PLAIN[0], PLAIN[1], PLAIN[1]])   # two user messages in a row
    assert model.chat_tokens(PLAIN) > 0


# A template variable as Qwen3's reads it: enable_thinking false opens the answer with an empty thought.
THINKING = ("{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
            "<think>\n\n</think>\n\n{% endif %}")
PREFILLED = [*PLAIN, {"role": "assistant", "content": "Order NW-1 is "}]


def test_the_web_counts_what_the_worker_renders_with_a_clients_template_options(tokenizer):
    own = tokenizer.chat_template
    tokenizer.chat_template = own + THINKING
    try:
        model = published(tokenizer)
        plain = render(tokenizer, PLAIN)
        no_thinking = TemplateOptions({"enable_thinking": False})
        thought = render(tokenizer, PLAIN, options=no_thinking)
        assert tokenizer.decode(thought[len(plain):]) == "<think>\n\n</think>\n\n", "the variable reached it"
        prefill = TemplateOptions(add_generation_prompt=False, continue_final_message=True)
        continued = render(tokenizer, PREFILLED, options=prefill)
        assert tokenizer.decode(continued).endswith("<|im_start|>assistant\nOrder NW-1 is "), "left open"
        closed = TemplateOptions(add_generation_prompt=False)
        assert tokenizer.decode(render(tokenizer, PREFILLED, options=closed)).endswith("Order NW-1 is <|im_end|>\n")
        for messages, options in ((PLAIN, no_thinking), (PREFILLED, prefill), (PREFILLED, closed),
                                  (PLAIN, TemplateOptions({"enable_thinking": True}))):
            for tools in (None, [LOOKUP]):
                assert model.chat_tokens(messages, tools, options) == len(render(tokenizer, messages, tools, options))
    finally:
        tokenizer.chat_template = own
