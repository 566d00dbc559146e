"""Conversations read from dataset records and tokenized with a chat template, with a mask of the
assistant's tokens. Independent of any objective: SFT uses it, preference data can too.

Two record formats:

* ``messages``: a list of ``{"role", "content"}`` turns, roles ``system``/``user``/``assistant``;
* ``alpaca``: ``instruction``, optional ``input`` and ``output``, read as a user turn
  (``instruction``, plus ``"\\n\\n" + input`` when there is one) and an assistant turn.

``columns`` maps these field names to the dataset's (``{"messages": "conversations",
"role": "from", "content": "value"}``), ``roles`` the dataset's role names to ours
(``{"human": "user", "gpt": "assistant"}``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

# ChatML, used only when asked for with chat_template="chatml". Each turn is
# "<|im_start|>ROLE\nCONTENT<|im_end|>\n"; the generation prompt is "<|im_start|>assistant\n".
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant")
FIELDS = ("messages", "instruction", "input", "output", "role", "content")
FORMATS = ("auto", "messages", "alpaca")


def resolve_template(tokenizer: Any, chat_template: Optional[str] = None) -> str:
    """The Jinja template to render with: the tokenizer's own (None), ChatML ("chatml"), or the
    string given. Never a silent default: a model must be prompted in the format it was tuned on."""
    if chat_template == "chatml":
        return CHATML
    if chat_template:
        return chat_template
    own = getattr(tokenizer, "chat_template", None)
    own = own.get("default") if isinstance(own, dict) else own
    if not own:
        raise ValueError(
            "the tokenizer has no chat template: pass chat_template='chatml' for the built-in "
            "ChatML format (<|im_start|>role\\n...<|im_end|>) or a Jinja template string"
        )
    return own


def field_names(fields: Sequence[str], columns: Optional[Mapping[str, Any]]) -> dict:
    """Our names of ``fields`` to the dataset's: each its own unless ``columns`` renames it."""
    unknown = sorted(set(columns or {}) - set(fields))
    if unknown:
        raise ValueError(f"columns maps unknown fields {unknown}: the fields are {fields}")
    return {field: field for field in fields} | dict(columns or {})


@dataclass(frozen=True)
class ChatFormat:
    """How records hold conversations: ``format`` ("messages" or "alpaca"), the dataset's column
    or key for each of our ``FIELDS`` (None: an absent optional ``input``), and role renames."""

    format: str
    names: Mapping[str, Optional[str]]
    roles: Mapping[str, str]

    @classmethod
    def detect(
        cls,
        column_names: Sequence[str],
        format: str = "auto",
        columns: Optional[Mapping[str, str]] = None,
        roles: Optional[Mapping[str, str]] = None,
    ) -> "ChatFormat":
        """Check the dataset's columns up front (``format="auto"`` picks from them)."""
        names = field_names(FIELDS, columns)
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        have = list(column_names)
        if format == "auto":
            alpaca = names["instruction"] in have and names["output"] in have
            format = "messages" if names["messages"] in have else "alpaca" if alpaca else ""
            if not format:
                raise ValueError(
                    f"cannot tell the format from the columns {have}: expected "
                    f"{names['messages']!r} (messages) or {names['instruction']!r} and "
                    f"{names['output']!r} (alpaca); name yours with columns={{...}}"
                )
        for field in ("messages",) if format == "messages" else ("instruction", "output"):
            if names[field] not in have:
                raise ValueError(
                    f"field {names[field]!r} of the {format} format not found; columns found: "
                    f"{have}; name yours with columns={{{field!r}: 'your_column'}}"
                )
        if names["input"] not in have:
            names["input"] = None
        return cls(format, names, dict(roles or {}))

    @classmethod
    def of_turns(cls, names: dict, roles: Optional[Mapping[str, str]]) -> "ChatFormat":
        """The format of message lists whose ``role``/``content`` keys ``names`` gives (they are
        taken out of ``names``): how records of pairs and examples hold their conversations."""
        turns = {"role": names.pop("role"), "content": names.pop("content")}
        return cls("messages", turns, dict(roles or {}))

    @property
    def record_columns(self) -> list[str]:
        """The dataset columns ``read`` uses."""
        used = ("messages",) if self.format == "messages" else ("instruction", "input", "output")
        return [self.names[field] for field in used if self.names[field] is not None]

    def _get(self, record: Mapping, field: str, where: str, text: bool = True) -> Any:
        value = record.get(self.names[field])
        if value is None:
            raise ValueError(
                f"{where}: field {self.names[field]!r} is missing or null; "
                f"available: {sorted(k for k, v in record.items() if v is not None)}"
            )
        if text and not isinstance(value, str):
            raise ValueError(
                f"{where}: field {self.names[field]!r} must be a string, got {type(value).__name__}"
            )
        return value

    def read(self, record: Mapping, index: int) -> list[dict[str, str]]:
        """The record's turns as ``[{"role", "content"}]`` with our role names."""
        where = f"sample {index}"
        if self.format == "alpaca":
            extra = self._get(record, "input", where) if record.get(self.names["input"]) else None
            user = self._get(record, "instruction", where) + (f"\n\n{extra}" if extra else "")
            output = self._get(record, "output", where)
            return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        return self.read_messages(self._get(record, "messages", where, text=False), where)

    def read_messages(self, messages: Sequence[Mapping], where: str) -> list[dict[str, str]]:
        """A list of turns as ``[{"role", "content"}]`` with our role names; ``where`` starts the
        errors (``"sample 3"``). Only ``names["role"]``/``names["content"]`` are read."""
        turns = []
        for turn, message in enumerate(messages):
            at = f"{where}, message {turn}"
            role, content = self._get(message, "role", at), self._get(message, "content", at)
            role = self.roles.get(role, role)
            if role not in ROLES:
                raise ValueError(
                    f"{at}: unknown role {role!r}; allowed roles are {ROLES} (rename the "
                    f"dataset's roles with roles={{{role!r}: 'user'}})"
                )
            turns.append({"role": role, "content": content})
        return turns


def drop_reason(messages: Sequence[Mapping[str, str]]) -> Optional[str]:
    """Why a conversation cannot be trained on (None: it can); the caller counts these."""
    replies = [m for m in messages if m["role"] == "assistant"]
    if not replies:
        return "no assistant turn"
    if any(not m["content"].strip() for m in replies):
        return "empty assistant turn"
    if messages[0]["role"] == "assistant":
        return "starts with an assistant turn"
    return None


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    template: str,
    index: int = 0,
    last_only: bool = False,
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and its assistant mask (1: an assistant token).
    With ``last_only`` only the last assistant turn is masked: the earlier ones are context (the
    prompt of a preference pair).

    Rendered incrementally: the tokens of the turns before assistant turn ``i`` with the
    generation prompt must be a prefix of those up to and including turn ``i``, which must be a
    prefix of the whole conversation's; the tokens in between are the reply: its content, its
    end-of-turn marker and whatever the template writes after it (ChatML: ``<|im_end|>\\n``).
    Everything else the template adds carries no loss. Call ``drop_reason`` first.
    """
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies or replies[0] == 0:
        raise ValueError(f"sample {index}: {drop_reason(messages)}")
    replies = replies[-1:] if last_only else replies
    try:
        prompts = _render(tokenizer, [messages[:i] for i in replies], template, True)
        turns = _render(tokenizer, [messages[: i + 1] for i in replies] + [messages], template)
    except Exception as err:  # a template's raise_exception, or a Jinja error
        raise ValueError(f"sample {index}: the chat template failed: {err}") from err
    encoded = tokenizer(prompts + turns, add_special_tokens=False)["input_ids"]
    ids, mask = encoded[-1], [0] * len(encoded[-1])
    for k, turn in enumerate(replies):
        prompt, upto = encoded[k], encoded[len(replies) + k]
        _check_prefix(prompt, upto, index, f"the turns before message {turn}")
        _check_prefix(upto, ids, index, f"the turns up to message {turn}")
        mask[len(prompt) : len(upto)] = [1] * (len(upto) - len(prompt))
    return ids, mask


def _render(tokenizer: Any, conversations: list, template: str, prompt: bool = False) -> list:
    return tokenizer.apply_chat_template(
        conversations, chat_template=template, tokenize=False, add_generation_prompt=prompt
    )


def _check_prefix(prefix: list[int], tokens: list[int], index: int, what: str) -> None:
    if tokens[: len(prefix)] != prefix:
        at = next((j for j, (a, b) in enumerate(zip(prefix, tokens)) if a != b), len(tokens))
        raise ValueError(
            f"sample {index}: the chat template renders {what} differently once later turns "
            f"follow (tokens differ from position {at}), so the assistant's tokens cannot be "
            "located: use a template that leaves earlier turns unchanged, e.g. "
            "chat_template='chatml'"
        )
