"""The model's tokenizer, loaded the way transformers loads it, with a fast cached path.

Loading (ENGINES.md §4.4): the HF ``tokenizers`` model from ``tokenizer.json``,
plus every ``tokenizer_config.json`` ``added_tokens_decoder`` entry, special token
and ``added_tokens.json`` entry missing from it, each with its flags; each must land
on its declared id. ``add_bos_token``/``add_eos_token`` override the Llama-family
post-processor (transformers ``LlamaTokenizerFast.update_post_processor``).

Speed: HF ``tokenizers`` first cuts the text on its non-normalized added tokens
and tokenizes every remaining piece on its own
(``AddedVocabulary::extract_and_normalize``). We make the same cut in Python and
memoise each piece's ids, so the repeated turns of a conversation cost a dict
lookup. A load-time self-check proves that path equal to whole-text encoding on a
corpus of tricky strings built from this tokenizer's own added tokens; if it is
not, the tokenizer falls back to whole-text encoding and says why.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

from tokenizers import AddedToken, Tokenizer

from mmroute.config import ConfigError
from mmroute.models.files import ModelFiles

log = logging.getLogger(__name__)

# Rust ``char::is_whitespace`` (Unicode White_Space), used by tokenizers for the
# lstrip/rstrip flags; Python's ``str.isspace`` differs (it includes U+001C..U+001F).
_WS = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)

# transformers' tokenizer classes that rebuild the post-processor from
# add_bos_token/add_eos_token (defaults True/False) at load time.
_LLAMA_LIKE = {
    "LlamaTokenizer",
    "LlamaTokenizerFast",
    "CodeLlamaTokenizer",
    "CodeLlamaTokenizerFast",
    "GemmaTokenizer",
    "GemmaTokenizerFast",
}

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

CACHE_PLAIN = "plain"  # every piece encoded alone
CACHE_ANCHORED = "anchored"  # pieces after the first encoded behind a special token
CACHE_OFF = "off"  # whole-text encoding


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    evictions: int = 0


class _SegmentCache:
    """LRU of piece → ids, bounded by the total number of cached ids."""

    def __init__(self, max_ids: int):
        self.max_ids = max_ids
        self._data: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._ids = 0
        self.stats = CacheStats()

    def get(self, key: str) -> tuple[int, ...] | None:
        val = self._data.get(key)
        if val is not None:
            self._data.move_to_end(key)
            self.stats.hits += 1
            self.stats.hit_tokens += len(val)
        return val

    def put(self, key: str, val: tuple[int, ...]) -> None:
        self.stats.misses += 1
        self.stats.miss_tokens += len(val)
        if len(val) > self.max_ids:
            return
        self._data[key] = val
        self._ids += len(val)
        while self._ids > self.max_ids and self._data:
            _, old = self._data.popitem(last=False)
            self._ids -= len(old)
            self.stats.evictions += 1

    def clear(self) -> None:
        self._data.clear()
        self._ids = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._data)


def _trie_pattern(words: Iterable[str]) -> str:
    """A regex matching the longest of ``words`` at the leftmost position
    (aho-corasick LeftmostLongest, as tokenizers uses), built as a trie so that
    thousands of added tokens (Gemma-3 has 6,415) stay fast."""
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = True

    def build(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch != ""]
        if not alts:
            return ""
        terminal = "" in node
        if len(alts) == 1 and not terminal:
            return alts[0]
        # Deeper branches first, the empty branch last: greedy → longest match.
        return "(?:" + "|".join(alts) + ("|)" if terminal else ")")

    return build(trie)


@dataclass(frozen=True)
class _Splitter:
    """The raw-text cut tokenizers makes on its non-normalized added tokens."""

    pattern: re.Pattern[str] | None
    ids: dict[str, int]
    lstrip: frozenset[str]
    rstrip: frozenset[str]
    single_word: frozenset[str]

    def split(self, text: str) -> list[tuple[int | None, int, int]]:
        """[(token_id | None, start, stop)] in order; None marks a plain piece."""
        out: list[tuple[int | None, int, int]] = []
        if self.pattern is None:
            return [(None, 0, len(text))] if text else out
        start_offset = 0
        n = len(text)
        for m in self.pattern.finditer(text):
            content = m.group(0)
            start, stop = m.start(), m.end()
            if content in self.single_word:
                before_ok = start == 0 or not _is_word_char(text[start - 1])
                after_ok = stop == n or not _is_word_char(text[stop])
                if not (before_ok and after_ok):
                    continue
            if content in self.lstrip:
                s = start
                while s > 0 and text[s - 1] in _WS:
                    s -= 1
                start = max(s, start_offset)
            if content in self.rstrip:
                while stop < n and text[stop] in _WS:
                    stop += 1
            if start > start_offset:
                out.append((None, start_offset, start))
            out.append((self.ids[content], start, stop))
            start_offset = stop
        if start_offset < n:
            out.append((None, start_offset, n))
        return out


def _is_word_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


class ModelTokenizer:
    """Encode text exactly as the engine's (HF fast) tokenizer does."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        special_tokens: dict[str, Any],
        prefix_ids: tuple[int, ...],
        suffix_ids: tuple[int, ...],
        cache_max_ids: int = 2_000_000,  # ~70 MB worst case (tuple slots + int objects)
        self_check: bool = True,
    ):
        self.tokenizer = tokenizer
        self.special_tokens = special_tokens  # template variables: bos_token, eos_token, ...
        self.prefix_ids = prefix_ids  # added by add_special_tokens=True
        self.suffix_ids = suffix_ids
        self.bos_token: str | None = special_tokens.get("bos_token")
        self.eos_token: str | None = special_tokens.get("eos_token")
        self.pad_token: str | None = special_tokens.get("pad_token")
        self.unk_token: str | None = special_tokens.get("unk_token")
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.pad_token_id = self.token_to_id(self.pad_token) if self.pad_token else None
        self.unk_token_id = self.token_to_id(self.unk_token) if self.unk_token else None
        self._cache = _SegmentCache(cache_max_ids)
        self._splitter = self._build_splitter()
        self._anchor: tuple[str, tuple[int, ...]] | None = self._pick_anchor()
        self.cache_mode = CACHE_PLAIN
        self.cache_reason = "not checked"
        if self_check:
            self._run_self_check()

    # ---- construction ---------------------------------------------------------------

    @classmethod
    def from_files(cls, files: ModelFiles, **kwargs: Any) -> "ModelTokenizer":
        if not files.tokenizer_json:
            raise ConfigError(
                f"{files.source}: no tokenizer.json (mmroute needs the fast tokenizer file; "
                "convert the tokenizer with transformers and save it)"
            )
        try:
            tok = Tokenizer.from_str(files.tokenizer_json)
        except Exception as exc:
            raise ConfigError(f"{files.source}: cannot load tokenizer.json: {exc}") from exc
        tok.no_truncation()
        tok.no_padding()
        tc = files.tokenizer_config
        special = _special_token_strings(tc, files.special_tokens_map)
        _merge_added_tokens(tok, files, special)
        prefix, suffix = _special_affixes(tok, tc, special)
        return cls(tok, special_tokens=special, prefix_ids=prefix, suffix_ids=suffix, **kwargs)

    def _build_splitter(self) -> _Splitter:
        ids: dict[str, int] = {}
        lstrip, rstrip, single = set(), set(), set()
        for tid, at in sorted(self.tokenizer.get_added_tokens_decoder().items()):
            if at.normalized or not at.content:
                continue  # matched after normalization, inside a piece: not a cut point
            ids[at.content] = tid
            if at.lstrip:
                lstrip.add(at.content)
            if at.rstrip:
                rstrip.add(at.content)
            if at.single_word:
                single.add(at.content)
        pattern = re.compile(_trie_pattern(ids)) if ids else None
        return _Splitter(pattern, ids, frozenset(lstrip), frozenset(rstrip), frozenset(single))

    def _pick_anchor(self) -> tuple[str, tuple[int, ...]] | None:
        """A special token with no strip flags, to encode later pieces behind it."""
        for tid, at in sorted(self.tokenizer.get_added_tokens_decoder().items()):
            if at.special and not at.normalized and not (at.lstrip or at.rstrip or at.single_word) and at.content:
                ids = tuple(self.tokenizer.encode(at.content, add_special_tokens=False).ids)
                if ids == (tid,):
                    return at.content, ids
        return None

    # ---- encoding -------------------------------------------------------------------

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, tid: int) -> str | None:
        return self.tokenizer.id_to_token(tid)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def cache_enabled(self) -> bool:
        return self.cache_mode != CACHE_OFF

    @property
    def cache_stats(self) -> CacheStats:
        return self._cache.stats

    def encode_whole(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The reference path: one call into HF tokenizers for the whole text."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            return [*self.prefix_ids, *ids, *self.suffix_ids]
        return ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.cache_mode == CACHE_OFF:
            return self.encode_whole(text, add_special_tokens)
        ids = self._encode_cached(text, self.cache_mode)
        if add_special_tokens:
            return [*self.prefix_ids, *ids, *self.suffix_ids]
        return ids

    def _encode_cached(self, text: str, mode: str) -> list[int]:
        out: list[int] = []
        cache = self._cache
        for tid, start, stop in self._splitter.split(text):
            if tid is not None:
                out.append(tid)
                continue
            piece = text[start:stop]
            anchored = mode == CACHE_ANCHORED and start > 0
            key = "\x00" + piece if anchored else piece  # distinct cache slots per mode
            got = cache.get(key)
            if got is None:
                got = self._encode_piece(piece, anchored)
                cache.put(key, got)
            out.extend(got)
        return out

    def _encode_piece(self, piece: str, anchored: bool) -> tuple[int, ...]:
        if not anchored or self._anchor is None:
            return tuple(self.tokenizer.encode(piece, add_special_tokens=False).ids)
        content, aids = self._anchor
        ids = self.tokenizer.encode(content + piece, add_special_tokens=False).ids
        if tuple(ids[: len(aids)]) != aids:  # cannot happen for a strip-free special token
            raise RuntimeError("anchor token did not encode first")
        return tuple(ids[len(aids):])

    # ---- self-check -----------------------------------------------------------------

    def self_check_corpus(self) -> list[str]:
        """Tricky strings built from this tokenizer's own added tokens."""
        added = [
            (tid, at)
            for tid, at in sorted(self.tokenizer.get_added_tokens_decoder().items())
            if at.content
        ]
        flagged = [at.content for _, at in added if at.lstrip or at.rstrip or at.single_word or at.normalized]
        specials = [at.content for _, at in added if at.special]
        others = [at.content for _, at in added if not at.special and not at.normalized]
        toks = list(dict.fromkeys(flagged[:40] + specials[:40] + others[:24] + others[-8:]))
        for key in ("bos_token", "eos_token"):
            if isinstance(self.special_tokens.get(key), str):
                toks.append(self.special_tokens[key])
        texts = [
            "Hello world",
            " Hello",
            "  two leading spaces",
            "\n",
            "\n\n",
            " \n ",
            "\t tab\t",
            "user\n",
            "What is in this image?",
            "<|image_1|>\nWhat is in this image?",
            "don't  stop\r\n",
            "日本語のテキスト",
            "naïve café ü",
            "emoji 🙂👍🏽 ok",
            "a",
            " ",
            "x\u3000y\u00a0z",
            "1234567 + 89 = ?",
            "<not_a_token>",
            "▁already▁marked",
        ]
        corpus = list(texts)
        for t in toks:
            corpus.append(t)
            for i, s in enumerate(texts):
                corpus.append(t + s)
                corpus.append(s + t)
                corpus.append(s + t + texts[(i + 3) % len(texts)])
                corpus.append(t + s + t)
        if len(toks) >= 2:
            for a, b in zip(toks, toks[1:] + toks[:1]):
                corpus.append(a + b)
                corpus.append(a + " " + b + "\n")
                corpus.append(" " + a + "\n\n" + b + " x")
        return corpus

    def check_cached(self, texts: Iterable[str], mode: str | None = None) -> str | None:
        """None if the cached path equals whole-text encoding on every text, else why not."""
        mode = mode or self.cache_mode
        if mode == CACHE_OFF:
            return None
        for text in texts:
            want = self.tokenizer.encode(text, add_special_tokens=False).ids
            got = self._encode_cached(text, mode)
            if got != want:
                return f"{mode} segment cache differs on {text!r}: {got[:12]} != {want[:12]}"
        return None

    def _run_self_check(self) -> None:
        corpus = self.self_check_corpus()
        reasons = []
        for mode in (CACHE_PLAIN, CACHE_ANCHORED):
            if mode == CACHE_ANCHORED and self._anchor is None:
                reasons.append("anchored: no strip-free special token to anchor on")
                continue
            self._cache.clear()
            try:
                why = self.check_cached(corpus, mode)
            except Exception as exc:  # never let the fast path break loading
                why = f"{mode}: {type(exc).__name__}: {exc}"
            if why is None:
                self._cache.clear()
                self.cache_mode = mode
                self.cache_reason = f"self-check passed on {len(corpus)} strings ({mode})"
                return
            reasons.append(why)
        self._cache.clear()
        self.cache_mode = CACHE_OFF
        self.cache_reason = "; ".join(reasons)
        log.warning("tokenizer segment cache disabled (whole-text encoding): %s", self.cache_reason)


# ---- loading helpers (transformers semantics) ----------------------------------------


def _special_token_strings(tc: dict[str, Any], stm: dict[str, Any]) -> dict[str, Any]:
    """bos/eos/unk/... strings (tokenizer_config first, then special_tokens_map) and
    additional_special_tokens, as transformers exposes them to chat templates."""
    out: dict[str, Any] = {}
    for key in _SPECIAL_KEYS:
        val = _token_content(tc.get(key)) if key in tc else _token_content(stm.get(key))
        if val is not None:
            out[key] = val
    extra = tc.get("additional_special_tokens")
    if extra is None:
        extra = stm.get("additional_special_tokens")
    if isinstance(extra, list):
        names = [c for c in (_token_content(v) for v in extra) if c is not None]
        out["additional_special_tokens"] = list(dict.fromkeys(names))
    return out


def _merge_added_tokens(tok: Tokenizer, files: ModelFiles, special: dict[str, Any]) -> None:
    """Register what transformers would add on top of tokenizer.json, in id order,
    and assert each declared id (PreTrainedTokenizerFast.__init__)."""
    present = {at.content for at in tok.get_added_tokens_decoder().values()}
    present_ids = set(tok.get_added_tokens_decoder())
    special_names = {v for k, v in special.items() if k != "additional_special_tokens" and isinstance(v, str)}
    special_names.update(special.get("additional_special_tokens", []))

    declared: list[tuple[int, AddedToken, bool]] = []
    decoder = files.tokenizer_config.get("added_tokens_decoder") or {}
    if not decoder and files.added_tokens:  # added_tokens.json is read only without the decoder
        decoder = {str(i): {"content": c, "special": c in special_names} for c, i in files.added_tokens.items()}
    for key, spec in decoder.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"{files.source}: bad added_tokens_decoder id {key!r}") from None
        if tid in present_ids or not isinstance(spec, dict) or not isinstance(spec.get("content"), str):
            continue
        is_special = bool(spec.get("special", False)) or spec["content"] in special_names
        at = AddedToken(
            spec["content"],
            single_word=bool(spec.get("single_word", False)),
            lstrip=bool(spec.get("lstrip", False)),
            rstrip=bool(spec.get("rstrip", False)),
            normalized=bool(spec.get("normalized", not is_special)),
            special=is_special,
        )
        declared.append((tid, at, is_special))
    for tid, at, is_special in sorted(declared, key=lambda x: x[0]):
        if at.content in present:
            got = tok.token_to_id(at.content)
            if got != tid:
                raise ConfigError(
                    f"{files.source}: added token {at.content!r} declared as id {tid} but tokenizer.json has {got}"
                )
            continue
        (tok.add_special_tokens if is_special else tok.add_tokens)([at])
        present.add(at.content)
        got = tok.token_to_id(at.content)
        if got != tid:
            raise ConfigError(
                f"{files.source}: added token {at.content!r} got id {got}, tokenizer_config declares {tid}"
            )
    # Special tokens that are still not added tokens become special added tokens.
    for name in sorted(special_names):
        if name not in present:
            tok.add_special_tokens([AddedToken(name, special=True, normalized=False)])
            present.add(name)


def _special_affixes(tok: Tokenizer, tc: dict[str, Any], special: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids add_special_tokens=True puts around a single sequence."""
    cls_name = str(tc.get("tokenizer_class") or "")
    llama_like = cls_name in _LLAMA_LIKE
    if llama_like or "add_bos_token" in tc or "add_eos_token" in tc:
        # transformers rebuilds the post-processor: [bos] $A [eos] per the flags.
        base_pre, base_suf = _post_processor_affixes(tok)
        bos, eos = special.get("bos_token"), special.get("eos_token")
        bos_id = tok.token_to_id(bos) if isinstance(bos, str) else None
        eos_id = tok.token_to_id(eos) if isinstance(eos, str) else None
        add_bos = bool(tc.get("add_bos_token", True if llama_like else bool(base_pre)))
        add_eos = bool(tc.get("add_eos_token", False if llama_like else bool(base_suf)))
        if not llama_like and "add_bos_token" not in tc:
            pre = base_pre
        else:
            pre = (bos_id,) if add_bos and bos_id is not None else ()
        if not llama_like and "add_eos_token" not in tc:
            suf = base_suf
        else:
            suf = (eos_id,) if add_eos and eos_id is not None else ()
        return pre, suf
    return _post_processor_affixes(tok)


def _post_processor_affixes(tok: Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What tokenizer.json's own post-processor adds, found by comparison."""
    for probe in ("a", "hello", "x y"):
        bare = tok.encode(probe, add_special_tokens=False).ids
        full = tok.encode(probe, add_special_tokens=True).ids
        if not bare:
            continue
        for i in range(len(full) - len(bare) + 1):
            if full[i : i + len(bare)] == bare:
                return tuple(full[:i]), tuple(full[i + len(bare) :])
    return (), ()
