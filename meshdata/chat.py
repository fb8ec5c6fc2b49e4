"""Chat templates for ``data prepare --chat``: a conversation -> its token ids and its loss mask.

A conversation is rendered with the tokenizer's own chat template (``chat_template.jinja`` beside
``tokenizer.json``, else ``tokenizer_config.json``'s ``chat_template``), in the Jinja environment
transformers renders it in (``transformers.utils.chat_template_utils``, 5.23): a sandboxed,
immutable environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension,
``raise_exception``, ``strftime_now``, a ``tojson`` that does not HTML-escape, the guarded ``dict``
and ``namespace``, and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as
variables. Chat templates are code from the internet: the sandbox is why jinja2 >= 3.1.6 is needed.

The loss mask comes from the template's ``{% generation %}`` ... ``{% endgeneration %}`` blocks, as
transformers' ``return_assistant_tokens_mask`` does it: each block's character span in the rendered
text, mapped to tokens through the encoding's offsets (first token = the one holding the span's first
character, last = the one holding its last). The rendered text is tokenized without added special
tokens (the template writes them). A template without a generation block is refused: nothing in it
says which tokens are the assistant's.
"""

from __future__ import annotations

import functools
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from meshdata.errors import DataError, one_line

KEY = "data.prepare"
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases, first = standard


@dataclass(frozen=True)
class ChatTemplate:
    """The template text, where it came from (for messages) and the special-token variables it sees."""

    text: str
    where: str
    variables: tuple[tuple[str, str], ...] = ()


def template_path(folder: str) -> str | None:
    """``chat_template.jinja`` of a tokenizer folder, if any (it wins over the config's entry, as in
    transformers)."""
    path = os.path.join(folder, TEMPLATE_FILE)
    return path if os.path.isfile(path) else None


def load_template(folder: str, config: dict) -> ChatTemplate:
    """The chat template of the tokenizer in ``folder`` (``config``: its merged tokenizer config)."""
    path = template_path(folder)
    if path is not None:
        with open(path, encoding="utf-8") as fh:
            text, where = fh.read(), path
    else:
        text, where = _config_template(config.get("chat_template")), os.path.join(folder, CONFIG_FILE)
    if not text:
        raise DataError(f"data prepare --chat: the tokenizer in {folder!r} has no chat template (no {TEMPLATE_FILE} "
                        f"and no \"chat_template\" in {CONFIG_FILE}); use the chat model's tokenizer directory "
                        "or add its template", key=KEY)
    if not _GENERATION.search(text):
        raise DataError(f"data prepare --chat: the chat template in {where!r} has no {{% generation %}} block, so "
                        "nothing marks the assistant's tokens; wrap each assistant message's content and its "
                        "end-of-turn token in {% generation %}...{% endgeneration %} (README: Data)", key=KEY)
    variables = tuple((k, _token_text(config[k])) for k in SPECIAL_TOKENS if config.get(k) is not None)
    template = ChatTemplate(text, where, variables)
    try:
        _compiled(text)
    except Exception as e:  # jinja2.TemplateSyntaxError and friends
        raise DataError(f"data prepare --chat: the chat template in {where!r} does not compile ({one_line(e)}); "
                        "fix the template", key=KEY) from None
    return template


def _config_template(entry) -> str:
    """``chat_template`` of tokenizer_config.json: a string, or a list of {name, template} (the
    ``default`` one is used)."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        return named.get("default") or ""
    return ""


def _token_text(token) -> str:
    return str(token.get("content", "")) if isinstance(token, dict) else str(token)


# -- messages ---------------------------------------------------------------------------------------


def check_messages(row, where) -> list[dict]:
    """The row's ``messages``: a non-empty list of objects with a string ``role`` and a ``content`` that
    is a string, a list of content parts or null. ``where()`` names the row for the message."""
    fix = 'write each line as {"messages": [{"role": "user", "content": "..."}, ...]}'
    if not isinstance(row, dict) or "messages" not in row:
        got = f"keys {sorted(row)[:8]}" if isinstance(row, dict) else type(row).__name__
        raise DataError(f"data prepare --chat: {where()}: expected an object with \"messages\", got {got}; {fix}",
                        key=KEY)
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"data prepare --chat: {where()}: \"messages\" is {_kind(messages)}, not a non-empty list of "
                        f"role/content objects; {fix}", key=KEY)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise DataError(f"data prepare --chat: {where()}: message {i} is not a role/content object ({_kind(m)}, "
                            f"needs a string \"role\" and a \"content\"); {fix}", key=KEY)
        if not (m["content"] is None or isinstance(m["content"], (str, list))):
            raise DataError(f"data prepare --chat: {where()}: message {i} is not a role/content object (its \"content\" "
                            f"is {_kind(m['content'])}, not a string, a list of parts or null); {fix}", key=KEY)
    return messages


def _kind(value) -> str:
    """What a JSON value is, in words (for messages)."""
    if isinstance(value, dict):
        return f"an object with keys {sorted(value)[:6]}"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    if value is None:
        return "null"
    return {str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _as_transformers_sees(messages: list[dict]) -> list[dict]:
    """What ``apply_chat_template`` hands the template: keys with a null value dropped, reasoning
    fields aliased (``thinking`` and ``reasoning_content`` both set from whichever is given)."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


# -- rendering --------------------------------------------------------------------------------------


def render(template: ChatTemplate, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered text, the character spans of its generation blocks)."""
    compiled = _compiled(template.text)
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    with compiled.environment.tracking(blocks, spans):
        for block in compiled.generate(messages=_as_transformers_sees(messages), tools=None, documents=None,
                                       add_generation_prompt=False, **dict(template.variables)):
            blocks.append(block)
    return "".join(blocks), spans


def encode(tokenizer, template: ChatTemplate, conversations: list[list[dict]], wheres: list) -> list[tuple]:
    """[(int32 token ids, int8 loss mask)] per conversation: rendered, tokenized as one batch."""
    texts, spans = [], []
    for messages, where in zip(conversations, wheres):
        try:
            text, marks = render(template, messages)
        except Exception as e:  # a template's raise_exception, an undefined name, a sandbox refusal
            raise DataError(f"data prepare --chat: {where()}: the chat template of {template.where!r} fails on this "
                            f"conversation ({one_line(e)}); fix the row or the template", key=KEY) from None
        texts.append(text)
        spans.append(marks)
    out = []
    for enc, marks in zip(tokenizer.encode_batch(texts, add_special_tokens=False), spans):
        out.append((np.asarray(enc.ids, np.int32), assistant_mask(enc, marks)))
    return out


def assistant_mask(encoding, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 on the tokens of the generation spans: transformers' char -> token rule, edge cases included
    (a span whose first character has no token stops the scan; one whose last has none, or token 0,
    runs to the end)."""
    mask = np.zeros(len(encoding.ids), np.int8)
    for start_char, end_char in spans:
        start = encoding.char_to_token(start_char)
        end = encoding.char_to_token(end_char - 1)
        if start is None:
            break
        mask[start : end + 1 if end else len(mask)] = 1
    return mask


@functools.lru_cache(maxsize=4)
def _compiled(text: str):
    return _environment().from_string(text)


def _environment():
    """transformers' chat-template environment (see the module docstring), plus generation tracking."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(), "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class(jinja2)
    return env


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes (<, >, &, '): a template's JSON must reach the model as written.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """``dict(...)`` for templates, without the attribute access a real ``dict`` type would expose."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_class(jinja2):
    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore names (no reaching CPython internals through it)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")

    return TemplateNamespace


def _generation_extension():
    """The ``{% generation %}`` tag: renders its body and, while tracking, records the body's span
    (offset = the length of everything rendered before it)."""
    import jinja2
    from jinja2.ext import Extension

    class GenerationTracker(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(tracking=self.tracking)
            self._blocks = None
            self._spans = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        def _generation(self, caller):
            rendered = caller()
            if self._spans is not None:
                start = len("".join(self._blocks))
                self._spans.append((start, start + len(rendered)))
            return rendered

        @contextmanager
        def tracking(self, blocks: list[str], spans: list[tuple[int, int]]):
            self._blocks, self._spans = blocks, spans
            try:
                yield
            finally:
                self._blocks = self._spans = None

    return GenerationTracker
