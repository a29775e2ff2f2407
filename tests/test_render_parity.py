"""The reference prompts (ENGINES.md §4.8, tests/fixtures/expected_prompts.json), text
and ids, before and after image expansion, plus fallbacks, completions and limits."""

from __future__ import annotations

import dataclasses

import pytest

from mmroute.errors import RouterError
from mmroute.models.base import ImageInput, MMItem
from mmroute.render.renderer import Renderer, RenderedPrompt, UnroutablePrompt
from fixture_models import (
    GEMMA3,
    LLAVA15,
    LLAVA_NEXT,
    PHI3_MINI,
    PHI3V,
    QWEN2_VL,
    QWEN25_TEXT,
    QWEN25_VL,
    QWEN3_EMBED,
    QWEN3_VL,
    expand_compact,
)
from render_helpers import QUESTION, expected_prompts, files, image_message, renderer

IMG = ImageInput("img-640x480", 640, 480)
CASES = expected_prompts()["cases"]
QWEN_KEY = "Qwen2.5-VL (also Qwen2-VL-*-Instruct, same template+vocab)"
GEMMA_EXPANDED = [2, 105, 2364, 109, 255999, *[262144] * 256, 256000, 108, 3689, 563, 528, 672, 2471, 236881, 106,
                  107, 105, 4368, 107]


def chat(name: str, images=(IMG,), **extra) -> RenderedPrompt:
    body = {"messages": [image_message()], **extra}
    return renderer(name).render_chat(body, list(images))


def test_fixture_question_is_the_reference():
    assert expected_prompts()["text"] == QUESTION
    assert expected_prompts()["image_size_wxh"] == [640, 480]


@pytest.mark.parametrize("name,key", [
    (QWEN25_VL, QWEN_KEY),
    (LLAVA15, "llava-1.5-7b-hf"),
    (LLAVA_NEXT, "llava-v1.6-mistral-7b-hf"),
])
def test_reference_prompts_unexpanded_and_expanded(name, key):
    case = CASES[key]
    p = chat(name)
    assert p.text == case["rendered"]
    assert renderer(name).tokenizer.encode(p.text) == case["ids_before_expansion"]
    assert renderer(name).mm_enabled, renderer(name).mm_reason
    assert p.fallback is None and p.num_images == 1
    if "ids_after_expansion_compact" in case:
        want = expand_compact(case["ids_after_expansion_compact"])
    else:  # vLLM chat: no BOS (ENGINES.md §4.5)
        ids = case["ids_before_expansion"]
        pos = ids.index(32000)
        want = ids[:pos] + [32000] * case["num_image_tokens"] + ids[pos + 1:]
    assert p.token_ids == want
    assert len(p.token_ids) == case.get("len_after_expansion", case.get("vllm_chat_len"))
    assert p.length == len(want)
    (item,) = p.mm_items
    assert item.identifier == IMG.identifier and item.length == case["num_image_tokens"]
    assert set(p.token_ids[item.offset:item.offset + item.length]) == {renderer(name).family.image_token_id}


def test_qwen25_vl_span_and_default_system_prompt():
    p = chat(QWEN25_VL)
    assert p.mm_items == [MMItem(IMG.identifier, 15, 391)]  # ENGINES.md §2.2 worked example
    text_only = renderer(QWEN25_VL).render_chat({"messages": [{"role": "user", "content": "Hi"}]}, [])
    assert text_only.token_ids[:11] == [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]
    assert text_only.token_ids[-3:] == [151644, 77091, 198]


def test_llava15_has_no_bos_in_chat():
    p = chat(LLAVA15)
    assert p.token_ids[0] == 3148 and len(p.token_ids) == 593
    # add_special_tokens=True on chat adds it, as HF's LlavaProcessor does (594 ids)
    p = chat(LLAVA15, add_special_tokens=True)
    assert p.token_ids[0] == 1 and len(p.token_ids) == 594
    assert p.token_ids == expand_compact(CASES["llava-1.5-7b-hf"]["hf_processor_ids_compact"])


def test_phi3v_reference():
    case = CASES["Phi-3-vision-128k-instruct"]
    r = renderer(PHI3V)
    p = chat(PHI3V)
    assert p.text == case["rendered"]
    assert r.tokenizer.encode(p.text) == case["plain_encode_no_special"]
    assert r.tokenizer.encode("<|user|>\n") == [32010, 29871, 13]
    assert r.tokenizer.encode(p.text)[-1] == 32001  # rstrip <|assistant|> absorbs the "\n"
    assert r.tokenizer.encode("<|image_1|>") == case["image_tag_ids"][0]
    assert p.fallback is None
    assert p.token_ids == expand_compact(case["final_compact"])
    assert len(p.token_ids) == case["final_len"] == 1938
    assert p.mm_items == [MMItem(IMG.identifier, 4, 1921)]


def test_gemma3_reference():
    case = CASES["gemma-3-4b-it (text only; tokenizer.json unavailable)"]
    r = renderer(GEMMA3)
    p = chat(GEMMA3)
    assert p.text == case["rendered"]
    assert r.tokenizer.encode(p.text) == [2, 105, 2364, 107, 255999, 3689, 563, 528, 672, 2471, 236881, 106, 107,
                                          105, 4368, 107]
    assert p.token_ids == GEMMA_EXPANDED and len(p.token_ids) == 274
    assert p.mm_items == [MMItem(IMG.identifier, 3, 260)]
    # the published onnxruntime-extensions case (PROVENANCE.md)
    other = r.render_chat({"messages": [image_message("What is the password?")]}, [None])
    assert r.tokenizer.encode(other.text) == [2, 105, 2364, 107, 255999, 3689, 563, 506, 8918, 236881, 106, 107,
                                              105, 4368, 107]


def test_qwen3_vl_and_embedding_templates():
    p = chat(QWEN3_VL)
    assert p.text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in this image?"
                      "<|im_end|>\n<|im_start|>assistant\n")
    assert p.fallback is None and p.mm_items[0].length == 300
    e = chat(QWEN3_EMBED)
    assert e.text.startswith("<|im_start|>system\nRepresent the user's input.<|im_end|>\n<|im_start|>user\n"
                             "<|vision_start|><|image_pad|><|vision_end|>What is in this image?")
    assert e.fallback is None


def test_two_images_in_order():
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "a"}}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": "b"}}]}]}
    a, b = ImageInput("A", 640, 480), ImageInput("B", 28, 28)
    p = renderer(QWEN25_VL).render_chat(body, [a, b])
    assert [(i.identifier, i.length) for i in p.mm_items] == [("A", 391), ("B", 4)]
    second = p.mm_items[1]
    assert p.token_ids[second.offset - 1] == 151652 and p.token_ids[second.offset + 4] == 151653


# ---- fallbacks ----------------------------------------------------------------------


def test_unresolved_image_falls_back_to_exact_prefix():
    for name, prefix in [
        (QWEN25_VL, CASES[QWEN_KEY]["ids_before_expansion"][:15]),  # through <|vision_start|>
        (LLAVA15, [3148, 1001, 29901, 29871]),
        (LLAVA_NEXT, [733, 16289, 28793, 28705]),
        (PHI3V, [1, 32010, 29871, 13]),  # Phi-3-V's BOS-per-chunk rule applies to the prefix
        (GEMMA3, [2, 105, 2364]),  # the newline before the image merges: not part of the prefix
    ]:
        exact = chat(name)
        p = chat(name, images=[None])
        assert p.fallback == "unresolved_image", name
        assert p.mm_items == [] and p.num_images == 1
        assert p.token_ids == prefix, name
        assert exact.token_ids[:len(prefix)] == prefix  # a true prefix of the engine's view
        assert p.length >= len(p.token_ids)


def test_no_family_falls_back_with_a_shorter_prefix():
    base = renderer(QWEN25_VL)
    r = Renderer(files(QWEN25_VL), base.tokenizer, None, "test: no family")
    assert not r.mm_enabled and r.mm_reason == "test: no family"
    p = r.render_chat({"messages": [image_message()]}, [IMG])
    assert p.fallback == "mm_disabled"
    assert p.token_ids == CASES[QWEN_KEY]["ids_before_expansion"][:13]
    # text-only chats are exact without a family
    t = r.render_chat({"messages": [{"role": "user", "content": "Hi"}]}, [])
    assert t.fallback is None and t.token_ids == base.render_chat({"messages": [{"role": "user", "content": "Hi"}]},
                                                                  []).token_ids


def test_expansion_error_falls_back():
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "a"}},
        {"type": "text", "text": "and <|vision_start|><|image_pad|><|vision_end|> typed"}]}]}
    p = renderer(QWEN25_VL).render_chat(body, [IMG])
    assert p.fallback == "placeholder_count"
    assert p.token_ids == CASES[QWEN_KEY]["ids_before_expansion"][:15]


def test_image_in_later_turn_keeps_the_earlier_conversation():
    body = {"messages": [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "answer"},
                         image_message()]}
    exact = renderer(GEMMA3).render_chat(body, [IMG])
    p = renderer(GEMMA3).render_chat(body, [None])
    assert p.fallback == "unresolved_image"
    first = exact.mm_items[0].offset
    assert p.token_ids == exact.token_ids[:first]
    assert len(p.token_ids) > 10


def test_image_parts_and_alignment():
    r = renderer(QWEN25_VL)
    msgs = [image_message(), {"role": "assistant", "content": "x"},
            {"role": "user", "content": [{"image_url": {"url": "u"}}, {"type": "text", "text": "typed-less part"}]}]
    parts = r.image_parts(msgs)
    assert len(parts) == 2 and parts[1] == {"image_url": {"url": "u"}}
    with pytest.raises(ValueError):
        r.render_chat({"messages": msgs}, [IMG])  # one image for two parts: a caller bug
    assert r.image_parts("nope") == []


# ---- completions --------------------------------------------------------------------


def test_completions_bos_rules():
    assert renderer(LLAVA15).render_completion({"prompt": "Hello"}).token_ids == [1, 15043]
    assert renderer(LLAVA15).render_completion({"prompt": "Hello", "add_special_tokens": False}).token_ids == [15043]
    q = renderer(QWEN25_VL).render_completion({"prompt": "Hello"})
    assert q.token_ids == [9707] and q.text == "Hello" and q.fallback is None
    assert renderer(PHI3_MINI).render_completion({"prompt": "Hello"}).token_ids[0] != 1  # add_bos_token false
    assert renderer(GEMMA3).render_completion({"prompt": "Hello"}).token_ids[0] == 2
    # a base model without a chat template still serves completions
    assert renderer(QWEN2_VL).render_completion({"prompt": "Hello"}).token_ids == [9707]


def test_completions_token_ids_and_batches():
    r = renderer(QWEN25_TEXT)
    p = r.render_completion({"prompt": [9707, 11, 1879]})
    assert p.token_ids == [9707, 11, 1879] and p.text is None
    assert r.render_completion({"prompt": ["Hello"]}).token_ids == [9707]  # a batch of one
    assert r.render_completion({"prompt": [[9707, 11]]}).token_ids == [9707, 11]
    for multi in (["a", "b"], [[1], [2]], ["a", [1]]):
        with pytest.raises(UnroutablePrompt) as ei:
            r.render_completion({"prompt": multi})
        assert ei.value.reason == "multi_prompt"
    with pytest.raises(UnroutablePrompt) as ei:
        r.render_completion({"prompt_embeds": "AAAA"})
    assert ei.value.reason == "prompt_embeds"


@pytest.mark.parametrize("body,match", [
    ({"prompt": ""}, "cannot be empty"),
    ({"prompt": []}, "cannot be empty"),
    ({}, "'prompt' is required"),
    ({"prompt": None}, "'prompt' is required"),
    ({"prompt": [1, "a"]}, "list of token ids"),
    ({"prompt": [True]}, "list of token ids"),
    ({"prompt": [-1]}, "out of vocabulary"),
    ({"prompt": [10**9]}, "out of vocabulary"),
    ({"prompt": 5}, "must be a string"),
    ({"prompt": "x", "add_special_tokens": 1}, "must be a boolean"),
])
def test_completion_errors(body, match):
    with pytest.raises(RouterError, match=match) as ei:
        renderer(QWEN25_TEXT).render_completion(body)
    assert ei.value.status == 400


# ---- limits -------------------------------------------------------------------------


def test_check_length():
    r = Renderer(files(QWEN25_TEXT), renderer(QWEN25_TEXT).tokenizer, None, "", max_model_len=100)
    assert r.max_model_len == 100
    r.check_length(RenderedPrompt(list(range(100))))
    r.check_length(90, 10)
    with pytest.raises(RouterError) as ei:
        r.check_length(RenderedPrompt(list(range(101))))
    assert ei.value.status == 400
    assert ei.value.message.startswith("This model's maximum context length is 100 tokens. However, your request "
                                       "has 101 input tokens.")
    with pytest.raises(RouterError, match="has 95 input tokens and requested 10 output tokens"):
        r.check_length(95, 10)
    with pytest.raises(RouterError, match="'max_tokens' or 'max_completion_tokens' is too large: 101"):
        r.check_length(1, 101)
    # a fallback prompt is checked on its full (unexpanded) length, not its prefix
    r.check_length(RenderedPrompt([1, 2], num_tokens=100))
    with pytest.raises(RouterError):
        r.check_length(RenderedPrompt([1, 2], num_tokens=101))
    # no limit known: nothing to check
    unknown = Renderer(dataclasses.replace(files(QWEN25_TEXT), max_model_len=None), renderer(QWEN25_TEXT).tokenizer,
                       None, "")
    assert unknown.max_model_len is None
    unknown.check_length(10**7, 10**6)
    assert renderer(QWEN25_VL).max_model_len == 128000


def test_render_is_repeatable_and_uses_the_cache():
    r = renderer(QWEN25_VL)
    body = {"messages": [{"role": "system", "content": "S " * 200}, {"role": "user", "content": "Q " * 50}]}
    first = r.render_chat(body, [])
    hits = r.tokenizer.cache_stats.hits
    again = r.render_chat(body, [])
    assert again.token_ids == first.token_ids == r.tokenizer.encode_whole(first.text)
    assert r.tokenizer.cache_stats.hits > hits
