"""Chat messages to a prompt, with the served model's own chat template.

The template comes from the model's tokenizer files (``chat_template.jinja``, or the
``chat_template`` of ``tokenizer_config.json``, as Hugging Face saves them) and is rendered the
way ``transformers``' ``apply_chat_template`` renders it: a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson`` that does not escape HTML,
``raise_exception``, ``strftime_now``, and the tokenizer's special tokens as variables. The
rendered text goes to the fleet as the prompt; the workers tokenize it with the same tokenizer
files (without adding special tokens again, as ``apply_chat_template(tokenize=True)`` does), and
the answer carries the exact generated token ids.

Tool-call messages (an assistant's ``tool_calls``, a ``tool`` message's ``tool_call_id``) and
the request's ``tools`` pass through to the template unchanged; the generated text is returned
as it is (a model's tool-call syntax is not parsed here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rollfleet.schemas.bounded_json import load_json
from rollfleet.schemas.errors import InvalidRequest

MAX_TEMPLATE_BYTES = 1024 * 1024
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_RESERVED = {"messages", "tools", "documents", "add_generation_prompt", "strftime_now"}
_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


class ChatTemplateError(InvalidRequest):
    """The chat template cannot be read, or refused the conversation (``raise_exception``)."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick(template: Any, tools: bool) -> str:
    """A template, or a list of named ones (``default``, and ``tool_use`` for requests with tools)."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("tool_use") if tools and "tool_use" in named else named.get("default")
        if isinstance(chosen, str):
            return chosen
    raise ChatTemplateError("tokenizer_config.json's chat_template is neither a string nor named templates")


@dataclass
class ChatTemplate:
    """A model's chat template and its special tokens, compiled once."""

    source: str | list[dict[str, Any]]
    special: dict[str, str] = field(default_factory=dict)
    origin: str = "template"

    def __post_init__(self) -> None:
        self._compiled: dict[str, Any] = {}

    @classmethod
    def from_dir(cls, path: Path) -> ChatTemplate:
        """The template of a tokenizer directory (a checkpoint, or a version directory of a store
        that holds the model's files)."""
        config_path = path / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            raw = config_path.read_bytes()
            loaded = load_json(raw, what=str(config_path), max_bytes=64 * MAX_TEMPLATE_BYTES)
            if not isinstance(loaded, dict):
                raise ChatTemplateError(f"{config_path} is not a JSON object")
            config = loaded
        special = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
        jinja = path / "chat_template.jinja"
        if jinja.is_file():
            if jinja.stat().st_size > MAX_TEMPLATE_BYTES:
                raise ChatTemplateError(f"{jinja} is larger than {MAX_TEMPLATE_BYTES} bytes")
            return cls(jinja.read_text(encoding="utf-8"), special, str(jinja))
        template = config.get("chat_template")
        if template is None:
            raise ChatTemplateError(f"{path} has no chat template (chat_template.jinja or tokenizer_config.json's)")
        if not isinstance(template, str | list):
            raise ChatTemplateError(f"{config_path}: chat_template must be a string or a list of named templates")
        return cls(template, special, str(config_path))

    def _template(self, tools: bool) -> Any:
        text = _pick(self.source, tools)
        if text not in self._compiled:
            self._compiled[text] = _environment().from_string(text)
        return self._compiled[text]

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        kwargs: dict[str, Any] | None = None,
        now: datetime | None = None,
    ) -> str:
        """The prompt text of a conversation (``now`` for templates that print the date)."""
        import jinja2

        context: dict[str, Any] = dict(self.special)
        reserved = set(kwargs or {}) & _RESERVED
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs may not set {sorted(reserved)}")
        context.update(kwargs or {})
        when = now or datetime.now()
        try:
            return str(
                self._template(bool(tools)).render(
                    messages=[_aliased(m) for m in messages],
                    tools=tools,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    strftime_now=lambda fmt: when.strftime(fmt),
                    **context,
                )
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from exc


_REASONING = ("reasoning_content", "thinking", "reasoning")


def _aliased(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name templates read it by (as transformers does)."""
    given = next((message[k] for k in _REASONING if message.get(k) is not None), None)
    if given is None:
        return message
    out = dict(message)
    out.setdefault("reasoning_content", given)
    out.setdefault("thinking", given)
    return out


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks):
        rendered as its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


# -- the request -------------------------------------------------------------------------------


def _content(value: Any, where: str) -> str | list[dict[str, Any]] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}: only text parts are accepted ({{'type': 'text', 'text': ...}})")
        return value
    raise InvalidRequest(f"{where} must be a string, a list of text parts, or null")


def messages_of(value: Any) -> list[dict[str, Any]]:
    """The ``messages`` of a chat request, checked for shape (roles, content types); every other
    field of a message (``tool_calls``, ``tool_call_id``, ``name``, reasoning) passes through."""
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in _ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}")
        _content(m.get("content"), f"messages[{i}].content")
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise InvalidRequest(f"messages[{i}].tool_calls must be a list")
        out.append(m)
    return out


def tools_of(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise InvalidRequest("tools must be a list of objects")
    return value
