"""ModelTokenizer: transformers loading semantics and the segment cache's exactness."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from mmroute.config import ConfigError
from mmroute.render.tokenizer import CACHE_ANCHORED, CACHE_OFF, CACHE_PLAIN, ModelTokenizer
from fixture_models import (
    GEMMA3,
    LLAVA15,
    LLAVA_NEXT,
    PHI3_MINI,
    PHI3V,
    QWEN25_TEXT,
    QWEN25_VL,
    QWEN3_TOK,
    TOKENIZER_MODELS,
)
from render_helpers import files, renderer


def tok(name: str) -> ModelTokenizer:
    return renderer(name).tokenizer


def test_every_declared_added_token_gets_its_id():
    for name in TOKENIZER_MODELS:
        t = tok(name)
        decl = files(name).tokenizer_config.get("added_tokens_decoder") or {}
        assert decl, name
        for key, spec in decl.items():
            assert t.token_to_id(spec["content"]) == int(key), (name, spec["content"])
            # and it encodes as that single id
            assert t.encode(spec["content"]) == [int(key)], (name, spec["content"])


def _strip_added(name: str, contents: set[str]):
    """The model's files with some added tokens missing from tokenizer.json."""
    f = files(name)
    tj = json.loads(f.tokenizer_json)
    tj["added_tokens"] = [a for a in tj["added_tokens"] if a["content"] not in contents]
    return dataclasses.replace(f, tokenizer_json=json.dumps(tj, ensure_ascii=False))


def test_added_tokens_decoder_merge_with_flags():
    # Phi-3-mini: drop the trailing added tokens from tokenizer.json; tokenizer_config
    # still declares them (with rstrip on <|assistant|>, <|end|>, <|user|>).
    dropped = {"<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>", "<|placeholder4|>",
               "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"}
    f = _strip_added(PHI3_MINI, dropped)
    base = ModelTokenizer.from_files(dataclasses.replace(f, tokenizer_config={}), self_check=False)
    assert base.token_to_id("<|user|>") is None  # really missing from tokenizer.json
    merged = ModelTokenizer.from_files(f)
    ref = tok(PHI3_MINI)
    for content in dropped:
        assert merged.token_to_id(content) == ref.token_to_id(content)
    decoder = merged.tokenizer.get_added_tokens_decoder()
    assert decoder[32001].rstrip and decoder[32001].special and not decoder[32001].normalized
    text = "<|user|>\nHi there<|end|>\n<|assistant|>\n"
    # Phi-3-mini's <|user|>/<|end|>/<|assistant|> are all rstrip: every "\n" is absorbed.
    assert merged.encode(text) == ref.encode(text) == [32010, 6324, 727, 32007, 32001]
    assert merged.cache_mode == CACHE_PLAIN


def test_declared_id_mismatch_is_a_config_error():
    f = files(PHI3_MINI)
    decl = dict(f.tokenizer_config["added_tokens_decoder"])
    decl["40000"] = {"content": "<|far|>", "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
    bad = dataclasses.replace(f, tokenizer_config={**f.tokenizer_config, "added_tokens_decoder": decl})
    with pytest.raises(ConfigError, match=r"<\|far\|>' got id 32011, tokenizer_config declares 40000"):
        ModelTokenizer.from_files(bad)
    # tokenizer.json and tokenizer_config disagreeing on an existing token
    decl = dict(f.tokenizer_config["added_tokens_decoder"])
    decl["32100"] = dict(decl.pop("32010"))
    bad = dataclasses.replace(f, tokenizer_config={**f.tokenizer_config, "added_tokens_decoder": decl})
    with pytest.raises(ConfigError, match=r"<\|user\|>' declared as id 32100 but tokenizer.json has 32010"):
        ModelTokenizer.from_files(bad)


def test_additional_special_tokens_become_special():
    f = files(QWEN25_TEXT)
    tc = dict(f.tokenizer_config)
    tc["additional_special_tokens"] = list(tc["additional_special_tokens"]) + ["<|brand_new|>"]
    t = ModelTokenizer.from_files(dataclasses.replace(f, tokenizer_config=tc))
    new_id = t.token_to_id("<|brand_new|>")
    assert new_id == t.vocab_size - 1
    assert t.encode("a<|brand_new|>b") == [64, new_id, 65]
    assert t.special_tokens["additional_special_tokens"][-1] == "<|brand_new|>"


def test_special_token_strings():
    assert tok(LLAVA15).special_tokens["bos_token"] == "<s>"
    assert tok(LLAVA15).bos_token_id == 1
    q = tok(QWEN25_VL)
    assert "bos_token" not in q.special_tokens and q.bos_token_id is None
    assert q.eos_token == "<|im_end|>" and q.eos_token_id == 151645
    assert q.pad_token == "<|endoftext|>"
    assert tok(GEMMA3).special_tokens["bos_token"] == "<bos>" and tok(GEMMA3).bos_token_id == 2
    # dict-valued special tokens ({"content": ...}) as in special_tokens_map.json
    f = files(LLAVA15)
    tc = {k: v for k, v in f.tokenizer_config.items() if k not in ("bos_token", "eos_token")}
    t = ModelTokenizer.from_files(dataclasses.replace(f, tokenizer_config=tc), self_check=False)
    assert t.bos_token == "<s>" and t.eos_token == "</s>"  # from special_tokens_map.json dicts


def test_add_special_tokens_bos_rules():
    hello = "Hello"
    assert tok(LLAVA15).encode(hello, True)[0] == 1  # add_bos_token: true
    assert tok(LLAVA_NEXT).encode(hello, True)[0] == 1
    assert tok(PHI3V).encode(hello, True)[0] == 1
    assert tok(GEMMA3).encode(hello, True)[0] == 2
    assert tok(PHI3_MINI).encode(hello, True) == tok(PHI3_MINI).encode(hello, False)  # add_bos_token: false
    assert tok(QWEN25_VL).encode(hello, True) == tok(QWEN25_VL).encode(hello, False) == [9707]
    for name in TOKENIZER_MODELS:
        assert tok(name).suffix_ids == ()  # add_eos_token false everywhere
    # add_eos_token on a Llama-family tokenizer appends </s>
    f = files(LLAVA15)
    t = ModelTokenizer.from_files(dataclasses.replace(f, tokenizer_config={**f.tokenizer_config,
                                                                           "add_eos_token": True,
                                                                           "add_bos_token": False}))
    assert t.encode(hello, True) == t.encode(hello, False) + [2]


def test_phi3_prefix_space_and_rstrip():
    t = tok(PHI3V)
    assert t.encode("<|user|>\n") == [32010, 29871, 13]
    ids = t.encode("<|user|>\nHi<|end|>\n<|assistant|>\n")
    assert ids[-1] == 32001  # <|assistant|> is rstrip: the "\n" is absorbed
    assert t.encode("<|image|>\n") == [32044]


def _random_corpus(t: ModelTokenizer, rng: random.Random, n: int) -> list[str]:
    decoder = t.tokenizer.get_added_tokens_decoder()
    added = [at.content for _, at in sorted(decoder.items())]
    added = added[:60] + added[-20:] + [at.content for at in decoder.values() if at.lstrip or at.rstrip][:40]
    atoms = [
        " ", "  ", "\n", "\n\n", "\t", " \n", "\r\n", "hello", "Hello", " world", "World", "don't", "it's",
        "日本", "語", "é", "ü", "🙂", "👍🏽", "123", "4567", ".", ",", "?", "!", "<", ">", "|", "<|", "|>",
        "<image>", "<|image_1|>", "▁", "▁▁", "_", "x", "ab", "  indent", "def f():", "\u3000", "\u00a0",
        "Ω", "𝔘", "\x0b", "\x1c",
    ]
    out = []
    for _ in range(n):
        k = rng.randint(1, 12)
        parts = [rng.choice(added) if rng.random() < 0.3 else rng.choice(atoms) for _ in range(k)]
        out.append("".join(parts))
    return out


@pytest.mark.parametrize("name", TOKENIZER_MODELS)
def test_segment_cache_equals_whole_text(name):
    t = tok(name)
    assert t.cache_mode == CACHE_PLAIN, t.cache_reason  # every fixture tokenizer keeps the fast path
    assert "self-check passed" in t.cache_reason
    rng = random.Random(f"seg-{name}")
    corpus = _random_corpus(t, rng, 1500)
    for text in corpus:
        assert t.encode(text) == t.encode_whole(text), (name, text)
        assert t.encode(text, True) == t.encode_whole(text, True), (name, text)
    # cached again (now hits) still exact
    for text in corpus[:200]:
        assert t.encode(text) == t.encode_whole(text), (name, text)


def _variant(name: str, **changes):
    f = files(name)
    tj = json.loads(f.tokenizer_json)
    tj.update(changes)
    return dataclasses.replace(f, tokenizer_json=json.dumps(tj, ensure_ascii=False))


def test_metaspace_prepend_first_needs_the_anchored_rule():
    # A SentencePiece-BPE tokenizer whose pre-tokenizer prefixes "▁" only at offset 0:
    # pieces after a special token must not get it, so plain per-piece encoding is wrong.
    f = _variant(LLAVA15, normalizer=None,
                 pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False})
    t = ModelTokenizer.from_files(f)
    assert t.cache_mode == CACHE_ANCHORED, t.cache_reason
    assert "plain segment cache differs" in t.check_cached(t.self_check_corpus(), CACHE_PLAIN)
    rng = random.Random(7)
    for text in _random_corpus(t, rng, 800):
        assert t.encode(text) == t.encode_whole(text), text
    assert t.encode("<s>Hi") != [1] + t.encode("Hi")  # the piece after <s> has no "▁" prefix


def test_cache_off_when_no_rule_holds():
    # Same Metaspace tokenizer, but every added token absorbs whitespace: no anchor exists.
    f = files(LLAVA15)
    tj = json.loads(f.tokenizer_json)
    tj["normalizer"] = None
    tj["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    for a in tj["added_tokens"]:
        a["rstrip"] = True
    t = ModelTokenizer.from_files(dataclasses.replace(f, tokenizer_json=json.dumps(tj)))
    assert t.cache_mode == CACHE_OFF
    assert not t.cache_enabled
    assert "no strip-free special token" in t.cache_reason
    for text in ["<s>Hello", "Hi <s> there", "x\n<image> y"]:
        assert t.encode(text) == t.encode_whole(text)


def test_lstrip_tokens_split_like_tokenizers():
    # Make Qwen's <|im_end|> lstrip+rstrip and <|im_start|> single_word: the Python cut
    # must absorb whitespace exactly as tokenizers does.
    f = files(QWEN3_TOK)
    tj = json.loads(f.tokenizer_json)
    for a in tj["added_tokens"]:
        if a["content"] == "<|im_end|>":
            a["lstrip"] = a["rstrip"] = True
        if a["content"] == "<|im_start|>":
            a["single_word"] = True
    t = ModelTokenizer.from_files(dataclasses.replace(f, tokenizer_json=json.dumps(tj, ensure_ascii=False)))
    assert t.cache_mode == CACHE_PLAIN, t.cache_reason
    rng = random.Random(11)
    for text in _random_corpus(t, rng, 1500) + ["a  <|im_end|>  b", "x<|im_start|>y", "x <|im_start|> y",
                                                 " \u3000<|im_end|>\u00a0\n<|im_end|> z"]:
        assert t.encode(text) == t.encode_whole(text), text


def test_cache_stats_and_bound():
    f = files(QWEN25_TEXT)
    t = ModelTokenizer.from_files(f, cache_max_ids=50)
    t.cache_stats.hits = t.cache_stats.misses = 0
    text = "<|im_start|>user\n" + "word " * 30 + "<|im_end|>\n"
    first = t.encode(text)
    again = t.encode(text)
    assert first == again == t.encode_whole(text)
    assert t.cache_stats.hits >= 2 and t.cache_stats.misses >= 1
    long_text = "<|im_start|>" + "many words here " * 40
    assert t.encode(long_text) == t.encode_whole(long_text)  # longer than the bound: encoded, not cached
    assert t._cache._ids <= 50


def test_missing_tokenizer_json_is_config_error():
    f = dataclasses.replace(files(QWEN25_VL), tokenizer_json=None)
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        ModelTokenizer.from_files(f)
    with pytest.raises(ConfigError, match="cannot load tokenizer.json"):
        ModelTokenizer.from_files(dataclasses.replace(f, tokenizer_json='{"version": "1.0"}'))
