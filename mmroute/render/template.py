"""Chat templates rendered the way transformers renders them for vLLM.

- Environment (transformers ``utils/chat_template_utils.py::_compile_jinja_template``,
  ENGINES.md §4.1): ``ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks)`` with
  ``loopcontrols``, a pass-through ``{% generation %}`` block, ``raise_exception``,
  ``strftime_now`` and a non-escaping, order-keeping ``tojson``.
- Selection (vLLM ``renderers/hf.py::resolve_chat_template``, §4.2): the request's
  template, then ``--chat-template``, then — without tools — the processor template,
  then the tokenizer's; named templates pick ``tool_use`` with tools, else ``default``.
- Content format (vLLM ``renderers/hf.py::_detect_content_format``, §4.3): "openai"
  when the template loops over a message's ``content``, else "string".
- Kwargs (vLLM ``renderers/params.py::merge_kwargs``, §2.5): top-level request fields
  override ``chat_template_kwargs``; ``None``/``"auto"`` never override.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterator, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mmroute.config import ConfigError
from mmroute.errors import RouterError
from mmroute.models.files import ChatTemplates, Template

CONTENT_FORMATS = ("auto", "openai", "string")

NO_TEMPLATE_MESSAGE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must "
    "provide a chat template if the tokenizer does not define one."
)


class GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` renders its body unchanged (transformers'
    AssistantTracker only records indices for assistant masks, which routing never needs)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_passthrough"), [], [], body).set_lineno(lineno)

    def _passthrough(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own filter HTML-escapes <>&' and sorts keys; transformers' does neither.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass(frozen=True)
class CompiledTemplate:
    source: str
    template: jinja2.Template
    content_format: str  # detected: "openai" | "string"
    variables: frozenset[str]  # undeclared variables the template reads


class TemplateCompiler:
    """Compiles each distinct template source once (bounded LRU for request templates)."""

    def __init__(self, max_entries: int = 64):
        self.env = make_environment()
        self._cache: OrderedDict[str, CompiledTemplate] = OrderedDict()
        self._pinned: dict[str, CompiledTemplate] = {}
        self.max_entries = max_entries

    def compile(self, source: str, *, pin: bool = False) -> CompiledTemplate:
        """Raises jinja2.TemplateSyntaxError for a broken template."""
        hit = self._pinned.get(source) or self._cache.get(source)
        if hit is not None:
            if source in self._cache:
                self._cache.move_to_end(source)
            return hit
        with warnings.catch_warnings():
            # Some shipped templates hold a "\s" string escape (LLaVA-NeXT's '<\s> '):
            # jinja's unicode-escape warns, transformers renders it the same.
            warnings.simplefilter("ignore", DeprecationWarning)
            ast = self.env.parse(source)
        compiled = CompiledTemplate(
            source=source,
            template=self.env.from_string(ast),
            content_format="openai" if _loops_over_content(ast) else "string",
            variables=frozenset(jinja2.meta.find_undeclared_variables(ast)),
        )
        if pin:
            self._pinned[source] = compiled
        else:
            self._cache[source] = compiled
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled


# ---- content-format detection (same rules as vLLM's AST walk, our own code) ---------


def _is_name(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_field(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    """``name['key']`` or ``name.key``."""
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or ``name.key``), possibly filtered, tested or sliced."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    return _is_field(node, name, key) if key else _is_name(node, name)


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every variable assigned from it (``set loop_messages = messages[1:]``)."""
    found = [name]
    queue = [name]
    while queue:
        cur = queue.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            if isinstance(assign.target, jinja2.nodes.Name) and _reads(assign.node, cur):
                new = assign.target.name
                if new not in found:
                    found.append(new)
                    queue.append(new)
    return found


def _loop_targets(root: jinja2.nodes.Template, sources: Sequence[str], key: str | None = None) -> Iterator[str]:
    for loop in root.find_all(jinja2.nodes.For):
        if not isinstance(loop.target, jinja2.nodes.Name):
            continue
        if any(_reads(loop.iter, src, key) for src in sources):
            yield loop.target.name


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    """``{% for message in messages %}…{% for part in message['content'] %}``."""
    message_vars = list(_loop_targets(root, _aliases(root, "messages")))
    return next(_loop_targets(root, message_vars, "content"), None) is not None


# ---- selection ----------------------------------------------------------------------


def load_chat_template_arg(value: str | None) -> str | None:
    """``--chat-template``: a file path, or the template itself (vLLM ``load_chat_template``)."""
    if value is None:
        return None
    path = os.path.expanduser(value)
    if not any(c in value for c in "{}\n"):
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.read()
        except OSError as exc:
            raise ConfigError(f"--chat-template {value!r} looks like a path but cannot be read: {exc}") from exc
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    return value


def _named(templates: Mapping[str, str], tools: bool) -> str | None:
    """transformers ``get_chat_template`` for a dict of named templates."""
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    return templates.get("default")


def select_template(
    templates: ChatTemplates,
    *,
    request_template: str | None,
    flag_template: str | None,
    has_tools: bool,
) -> str:
    """The template source vLLM uses for this request; RouterError 400 if none."""
    tok = templates.tokenizer
    for given in (request_template, flag_template):
        if given is not None:
            # A name among the tokenizer's named templates selects that template.
            if isinstance(tok, dict) and given in tok:
                return tok[given]
            return given
    order: list[Template | None] = [tok] if has_tools else [templates.processor, tok]
    for cand in order:
        if isinstance(cand, str):
            return cand
        if isinstance(cand, dict):
            named = _named(cand, has_tools)
            if named is not None:
                return named
            if cand is tok:
                raise RouterError(
                    400,
                    "This model has multiple chat templates with no default specified! Please either pass a "
                    "chat template or the name of the template you wish to use to the `chat_template` argument.",
                )
    raise RouterError(400, NO_TEMPLATE_MESSAGE)


# ---- kwargs -------------------------------------------------------------------------

_UNSET = (None, "auto")
_FORBIDDEN_KWARGS = ("chat_template", "tokenize")


def merge_template_kwargs(body: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Request-level template kwargs: ``--default-chat-template-kwargs`` < the request's
    ``chat_template_kwargs`` < its top-level fields (vLLM ``build_chat_params``)."""
    ctk = body.get("chat_template_kwargs")
    if ctk is None:
        ctk = {}
    if not isinstance(ctk, dict):
        raise RouterError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    bad = sorted(k for k in ctk if k in _FORBIDDEN_KWARGS)
    if bad:
        raise RouterError(400, f"Found unexpected chat template kwargs from request: {set(bad)}",
                          param="chat_template_kwargs")
    top: dict[str, Any] = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "documents": body.get("documents"),
        "reasoning_effort": body.get("reasoning_effort"),
    }
    effort = body.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in ctk:
        top["enable_thinking"] = effort != "none"
    merged: dict[str, Any] = dict(defaults or {})
    merged.update({k: v for k, v in ctk.items() if not _is_unset(v)} if defaults else ctk)
    merged.update({k: v for k, v in top.items() if not _is_unset(v)})
    return merged


def _is_unset(v: Any) -> bool:
    return v is None or (isinstance(v, str) and v == "auto")


# ---- rendering ----------------------------------------------------------------------


def render_template(
    compiled: CompiledTemplate,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    kwargs: Mapping[str, Any],
    special_tokens: Mapping[str, Any],
) -> str:
    """``tokenizer.apply_chat_template(..., tokenize=False)``; jinja errors propagate."""
    kw = dict(kwargs)
    continue_final = bool(kw.pop("continue_final_message", False))
    add_gen = kw.pop("add_generation_prompt", False)
    documents = kw.pop("documents", None)
    if continue_final and add_gen:
        raise RouterError(
            400,
            "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message "
            "when you want the model to continue the final message, and add_generation_prompt when you want "
            "to add a header that will prompt it to start a new assistant message instead.",
        )
    for clash in ("messages", "conversation", "tools"):
        if clash in kw:
            raise RouterError(400, f"chat_template_kwargs must not set {clash!r}", param="chat_template_kwargs")
    if documents is not None and (
        not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents)
    ):
        raise RouterError(400, "Documents should be a list of dicts with 'title' and 'text' keys!", param="documents")
    # vLLM drops kwargs the template does not read (resolve_chat_template_kwargs).
    template_vars = {**special_tokens, **{k: v for k, v in kw.items() if k in compiled.variables}}
    text = compiled.template.render(
        messages=messages, tools=tools, documents=documents, add_generation_prompt=add_gen, **template_vars
    )
    if continue_final:
        text = truncate_final_message(text, messages)
    return text


def truncate_final_message(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """transformers ``continue_final_message``: cut right after the final message's
    (last text block's) content, keeping its leading-space convention."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, Mapping) and "text" in block:
                final = block["text"]
                break
        else:
            raise RouterError(400, "continue_final_message is set but we could not find any text to continue "
                                   "in the final message!")
    if not isinstance(final, str):
        raise RouterError(400, "continue_final_message is set but the final message has no text content")
    if final.strip() not in rendered:
        raise RouterError(
            400,
            "continue_final_message is set but the final message does not appear in the chat after applying "
            "the chat template! This can happen if the chat template deletes portions of the final message. "
            "Please verify the chat template and final message in your chat to ensure they are compatible.",
        )
    loc = rendered.rindex(final.strip())
    if rendered[loc : loc + len(final.lstrip())] == final:
        return rendered[: loc + len(final.lstrip())]
    return rendered[: loc + len(final.strip())]
