"""Chat templates: HF jinja environment, selection, content formats, kwargs, continue."""

from __future__ import annotations

import dataclasses
import datetime
import json

import pytest

from mmroute.config import ConfigError
from mmroute.errors import RouterError
from mmroute.models.files import ChatTemplates
from mmroute.render.renderer import Renderer
from mmroute.render.template import (
    NO_TEMPLATE_MESSAGE,
    TemplateCompiler,
    load_chat_template_arg,
    merge_template_kwargs,
    select_template,
)
from fixture_models import GEMMA3, LLAVA15, LLAVA_NEXT, PHI3V, QWEN25_TEXT, QWEN25_VL, QWEN3_EMBED, QWEN3_TOK, QWEN3_VL
from render_helpers import QUESTION, files, image_message, renderer

QWEN_TOOLS_HEADER = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)


def text_of(name: str, body: dict, images=None) -> str:
    r = renderer(name)
    n = len(r.image_parts(body["messages"]))
    return r.render_chat(body, images if images is not None else [None] * n).text


def with_templates(name: str, templates: ChatTemplates, **kw) -> Renderer:
    base = renderer(name)
    f = dataclasses.replace(files(name), chat_templates=templates)
    return Renderer(f, base.tokenizer, base.family, "", **kw)


# ---- jinja environment --------------------------------------------------------------


def test_tojson_does_not_escape_or_sort_with_qwen_tool_template():
    tool = {"type": "function", "function": {
        "name": "get_weather",
        "description": "Get <weather> & 'temp' for Zürich",
        "parameters": {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "number"}},
                       "required": ["zeta"]},
    }}
    bare_tool = {"type": "function", "function": {"name": "noop"}}  # description/parameters default to null
    body = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"zeta\": \"Zürich <3\", \"alpha\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"},
                                                               {"type": "text", "text": "& warm"}]},
        ],
        "tools": [tool, bare_tool],
    }
    text = text_of(QWEN25_TEXT, body)
    expected = (
        QWEN_TOOLS_HEADER
        + "\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get <weather> & "
        "'temp' for Zürich\", \"parameters\": {\"type\": \"object\", \"properties\": {\"zeta\": {\"type\": "
        "\"string\"}, \"alpha\": {\"type\": \"number\"}}, \"required\": [\"zeta\"]}}}"
        + "\n{\"type\": \"function\", \"function\": {\"name\": \"noop\", \"description\": null, \"parameters\": null}}"
        + QWEN_TOOLS_FOOTER
        + "<|im_start|>user\nWeather?<|im_end|>\n"
        + "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        "{\"zeta\": \"Zürich <3\", \"alpha\": 1}}\n</tool_call><|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\nsunny\n& warm\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n"
    )
    assert text == expected


def test_invalid_tool_call_arguments_become_empty_object():
    body = {"messages": [{"role": "user", "content": "x"},
                         {"role": "assistant", "tool_calls": [{"type": "function",
                                                               "function": {"name": "f", "arguments": "{oops"}}]}],
            "add_generation_prompt": False}
    assert "{\"name\": \"f\", \"arguments\": {}}" in text_of(QWEN25_TEXT, body)
    bad = {"messages": [{"role": "assistant", "tool_calls": [{"type": "code", "function": {}}]}]}
    with pytest.raises(RouterError, match="of type 'function'"):
        renderer(QWEN25_TEXT).render_chat(bad, [])


def test_generation_block_passthrough_llava15():
    body = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                         {"role": "user", "content": "Bye"}]}
    assert text_of(LLAVA15, body) == "USER: Hi ASSISTANT: Hello there USER: Bye ASSISTANT:"


def test_raise_exception_is_a_400():
    body = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    with pytest.raises(RouterError) as ei:
        renderer(GEMMA3).render_chat(body, [])
    assert ei.value.status == 400
    assert ei.value.message == "Conversation roles must alternate user/assistant/user/assistant/..."
    with pytest.raises(RouterError, match="Only user and assistant roles are supported!"):
        renderer(LLAVA_NEXT).render_chat({"messages": [{"role": "system", "content": "s"}]}, [])


def test_strftime_now_and_loopcontrols():
    c = TemplateCompiler().compile("{{ strftime_now('%Y') }}{% for i in [1,2,3] %}{% if i == 2 %}{% break %}"
                                   "{% endif %}{{ i }}{% endfor %}")
    assert c.template.render() == f"{datetime.date.today().year}1"
    # sandboxed: no mutation of lists from templates
    c = TemplateCompiler().compile("{% set x = [] %}{{ x.append(1) }}")
    with pytest.raises(Exception):
        c.template.render()


# ---- content format -----------------------------------------------------------------


@pytest.mark.parametrize("name,fmt", [
    (QWEN25_VL, "openai"), (QWEN3_VL, "openai"), (QWEN3_EMBED, "openai"), (LLAVA15, "openai"),
    (LLAVA_NEXT, "openai"), (GEMMA3, "openai"), (PHI3V, "string"), (QWEN25_TEXT, "string"), (QWEN3_TOK, "string"),
])
def test_content_format_detection(name, fmt):
    t = files(name).chat_templates
    src = t.processor if isinstance(t.processor, str) else t.tokenizer
    assert TemplateCompiler().compile(src).content_format == fmt


def test_content_format_via_aliases_and_filters():
    comp = TemplateCompiler()
    assert comp.compile("{% set ms = messages[1:] %}{% for m in ms %}{% for c in m.content | list %}"
                        "{{ c }}{% endfor %}{% endfor %}").content_format == "openai"
    assert comp.compile("{% for m in messages %}{{ m['content'] }}{% endfor %}").content_format == "string"
    assert comp.compile("{% for m in messages %}{% for c in other.content %}{% endfor %}{% endfor %}"
                        ).content_format == "string"


def test_string_format_placeholders_phi3v():
    r = renderer(PHI3V)
    body = {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}},
                                     {"type": "text", "text": "One"},
                                     {"type": "image_url", "image_url": "b"},  # plain-string image_url
                                     {"type": "text", "text": "Two"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "Three"}, {"type": "image_url", "image_url": {"url": "c"}}]},
    ]}
    assert len(r.image_parts(body["messages"])) == 3
    text = r.render_chat(body, [None, None, None]).text
    assert text == ("<|user|>\n<|image_1|>\n<|image_2|>\nOne\nTwo<|end|>\n<|assistant|>\nok<|end|>\n"
                    "<|user|>\n<|image_3|>\nThree<|end|>\n<|assistant|>\n")
    # a placeholder already in the text is not added again (vLLM counts it)
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "see <|image_1|> here"},
                                                      {"type": "image_url", "image_url": {"url": "a"}}]}]}
    assert r.render_chat(body, [None]).text == "<|user|>\nsee <|image_1|> here<|end|>\n<|assistant|>\n"
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "<|image_1|><|image_1|>"},
                                                      {"type": "image_url", "image_url": {"url": "a"}}]}]}
    with pytest.raises(RouterError, match="Found more '<|image_1|>' placeholders"):
        r.render_chat(body, [None])


def test_openai_format_parts():
    r = renderer(QWEN25_VL)
    body = {"messages": [{"role": "user", "content": ["plain string part", {"type": "image_url", "image_url": {"url": "x"}},
                                                      {"type": "text", "text": None}, {"type": "input_text", "text": "!"}]}],
            "chat_template_kwargs": {"add_vision_id": True}}
    text = r.render_chat(body, [None]).text
    assert text.endswith("<|im_start|>user\nplain string partPicture 1: <|vision_start|><|image_pad|><|vision_end|>!"
                         "<|im_end|>\n<|im_start|>assistant\n")


def test_part_errors_and_unsupported_media():
    r = renderer(QWEN25_VL)
    with pytest.raises(RouterError, match="Unsupported chat content part type: 'hologram'"):
        r.render_chat({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, [])
    p = r.render_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "video_url", "video_url": {"url": "v"}}]}]}, [])
    assert p.fallback == "unsupported_modality" and p.token_ids == [] and p.mm_items == []


@pytest.mark.parametrize("body,match", [
    ({"messages": []}, "non-empty list"),
    ({"messages": "hi"}, "non-empty list"),
    ({"messages": [1]}, r"messages\[0\] must be an object"),
    ({"messages": [{"content": "x"}]}, "needs a string 'role'"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\] \(user\) needs 'content'"),
    ({"messages": [{"role": "user", "content": 5}]}, "must be a string or a list of parts"),
    ({"messages": [{"role": "user", "content": [3]}]}, r"content\[0\] must be an object"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}, "'tools' must be a list"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "'function' object"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}, "must be an object"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": 3}, "'chat_template' must be a string"),
    ({"messages": [{"role": "user", "content": "x"}], "add_special_tokens": "yes"}, "must be a boolean"),
])
def test_validation_errors_are_400(body, match):
    with pytest.raises(RouterError, match=match) as ei:
        renderer(QWEN25_TEXT).render_chat(body, [])
    assert ei.value.status == 400


def test_assistant_content_may_be_null():
    body = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}],
            "add_generation_prompt": False}
    assert text_of(QWEN25_TEXT, body).endswith("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n")


# ---- selection ----------------------------------------------------------------------


def test_processor_template_without_tools_tokenizer_template_with_tools():
    body = {"messages": [image_message()]}
    assert text_of(LLAVA_NEXT, body) == "[INST] <image>\nWhat is in this image? [/INST]"
    body["tools"] = [{"type": "function", "function": {"name": "f"}}]
    # Mistral tokenizer template: "string" format, so the placeholder goes before the text
    assert text_of(LLAVA_NEXT, body) == "<s>[INST] <image>\nWhat is in this image? [/INST]"


def test_named_templates():
    named = {"default": "D:{{ messages[0]['content'] }}", "tool_use": "T:{{ tools | length }}", "rag": "R"}
    r = with_templates(QWEN25_TEXT, ChatTemplates(processor=None, tokenizer=named))
    msg = {"messages": [{"role": "user", "content": "hi"}]}
    assert r.render_chat(msg, []).text == "D:hi"
    assert r.render_chat({**msg, "tools": [{"type": "function", "function": {"name": "f"}}]}, []).text == "T:1"
    assert r.render_chat({**msg, "chat_template": "rag"}, []).text == "R"
    # a dict of templates with no default
    r = with_templates(QWEN25_TEXT, ChatTemplates(tokenizer={"rag": "R"}))
    with pytest.raises(RouterError, match="no default specified"):
        r.render_chat(msg, [])
    assert select_template(ChatTemplates(processor={"default": "P"}, tokenizer="K"), request_template=None,
                           flag_template=None, has_tools=False) == "P"
    assert select_template(ChatTemplates(processor={"default": "P"}, tokenizer="K"), request_template=None,
                           flag_template=None, has_tools=True) == "K"


def test_request_then_flag_then_model_template(tmp_path):
    msg = {"messages": [{"role": "user", "content": "hi"}]}
    r = with_templates(QWEN25_TEXT, files(QWEN25_TEXT).chat_templates, chat_template="F:{{ messages | length }}")
    assert r.render_chat(msg, []).text == "F:1"
    assert r.render_chat({**msg, "chat_template": "Q:{{ add_generation_prompt }}"}, []).text == "Q:True"
    path = tmp_path / "tpl.jinja"
    path.write_text("P:{{ messages[0].content }}")
    assert load_chat_template_arg(str(path)) == "P:{{ messages[0].content }}"
    assert load_chat_template_arg("{{ x }}") == "{{ x }}"
    assert load_chat_template_arg(None) is None
    with pytest.raises(ConfigError, match="looks like a path"):
        load_chat_template_arg(str(tmp_path / "nope.jinja"))
    with pytest.raises(RouterError, match="invalid chat template") as ei:
        r.render_chat({**msg, "chat_template": "{% if %}"}, [])
    assert ei.value.status == 400


def test_no_template_is_a_400():
    r = with_templates(QWEN25_TEXT, ChatTemplates())
    with pytest.raises(RouterError) as ei:
        r.render_chat({"messages": [{"role": "user", "content": "hi"}]}, [])
    assert ei.value.status == 400 and ei.value.message == NO_TEMPLATE_MESSAGE


def test_request_templates_are_compiled_once():
    r = renderer(QWEN25_TEXT)
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "X{{ messages[0].content }}"}
    r.render_chat(body, [])
    compiled = r.compiler.compile(body["chat_template"])
    r.render_chat(body, [])
    assert r.compiler.compile(body["chat_template"]) is compiled


# ---- kwargs -------------------------------------------------------------------------


def test_add_generation_prompt_precedence():
    msgs = [{"role": "user", "content": "hi"}]
    base = "<|im_start|>user\nhi<|im_end|>\n"
    # the top-level default (True) overrides the same key inside chat_template_kwargs
    assert text_of(QWEN3_TOK, {"messages": msgs, "chat_template_kwargs": {"add_generation_prompt": False}}) == (
        base + "<|im_start|>assistant\n")
    assert text_of(QWEN3_TOK, {"messages": msgs, "add_generation_prompt": False,
                               "chat_template_kwargs": {"add_generation_prompt": True}}) == base
    assert text_of(QWEN3_TOK, {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}) == (
        base + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # reasoning_effort derives enable_thinking unless chat_template_kwargs sets it
    assert text_of(QWEN3_TOK, {"messages": msgs, "reasoning_effort": "none"}).endswith("<think>\n\n</think>\n\n")
    assert text_of(QWEN3_TOK, {"messages": msgs, "reasoning_effort": "none",
                               "chat_template_kwargs": {"enable_thinking": True}}).endswith("assistant\n")
    assert text_of(QWEN3_TOK, {"messages": msgs, "reasoning_effort": "high"}).endswith("assistant\n")


def test_merge_template_kwargs_rules():
    m = merge_template_kwargs({"chat_template_kwargs": {"a": 1, "documents": [{"title": "t"}]}, "documents": None})
    assert m == {"a": 1, "documents": [{"title": "t"}], "add_generation_prompt": True,
                 "continue_final_message": False}
    m = merge_template_kwargs({"chat_template_kwargs": {"x": None}}, defaults={"x": 5, "y": 1})
    assert m["x"] == 5 and m["y"] == 1
    with pytest.raises(RouterError, match="unexpected chat template kwargs"):
        merge_template_kwargs({"chat_template_kwargs": {"tokenize": True}})
    body = {"messages": [{"role": "user", "content": "hi"}], "documents": [{"title": "Doc", "text": "x"}],
            "chat_template": "{{ documents[0].title }}|{{ custom }}", "chat_template_kwargs": {"custom": "c"}}
    assert text_of(QWEN25_TEXT, body) == "Doc|c"
    with pytest.raises(RouterError, match="must not set 'messages'"):
        renderer(QWEN25_TEXT).render_chat({**body, "chat_template_kwargs": {"messages": []}}, [])


def test_continue_final_message():
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is "}]
    body = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False}
    # the template keeps the trailing space: cut right after the message as written
    assert text_of(QWEN25_VL, body).endswith("<|im_start|>assistant\nThe answer is ")
    # Gemma trims message content: cut after the stripped text
    assert text_of(GEMMA3, body) == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nThe answer is"
    with pytest.raises(RouterError, match="Cannot set both"):
        renderer(QWEN25_VL).render_chat({**body, "add_generation_prompt": True}, [])
    # only continue_final_message: add_generation_prompt defaults to true -> incompatible
    with pytest.raises(RouterError, match="not compatible"):
        renderer(QWEN25_VL).render_chat({"messages": msgs, "continue_final_message": True}, [])
    bad = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}], "continue_final_message": True,
        "add_generation_prompt": False}
    with pytest.raises(RouterError, match="could not find any text to continue"):
        renderer(QWEN25_VL).render_chat(bad, [None])
    # ids of a continued message: no <|im_end|> after it
    p = renderer(QWEN25_VL).render_chat(body, [])
    assert p.token_ids[-1] != 151645 and p.fallback is None


def test_tokens_for_text_only_chat_match_encode():
    r = renderer(QWEN3_VL)
    body = {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                         {"role": "user", "content": QUESTION}]}
    p = r.render_chat(body, [])
    assert p.text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is in this image?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert p.token_ids == r.tokenizer.encode_whole(p.text) and p.num_images == 0 and p.fallback is None
    assert json.loads(json.dumps(p.token_ids)) == p.token_ids
