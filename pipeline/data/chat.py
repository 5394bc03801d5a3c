"""Chat data: one internal conversation form, input-format converters, and ChatML.

Internal form
-------------
A conversation is a list of :class:`Message` dicts ``{"role", "content"}`` with
``role`` in :data:`ROLES` and ``content`` a string that is not blank (:func:`blank`).
The order rules (checked by :func:`validate_messages`) are those of the usual chat data:

- an optional ``system`` message, only as the first message;
- then ``user`` and ``assistant`` alternating, beginning with ``user``;
- a training example (``complete=True``) ends with an ``assistant`` message, and
  has one that is trained (``weight`` not 0), so every example has something to
  learn. A prompt for generation may end anywhere.

An assistant message may carry ``"weight": 0`` (OpenAI's fine-tuning format):
it stays in the conversation as context but is not trained. ``weight`` is 0 or
1; 1, the default, is not kept in the message, and is refused on a system or
user message (those are never trained).

Content is kept verbatim (no stripping): whitespace can matter in code answers.

Input formats
-------------
:data:`FORMATS` maps a format name to its converter; ``auto`` detects the format
of each record from its keys (:func:`detect_format`). :func:`to_messages` converts
and validates one record, raising :class:`ChatFormatError` whose ``reason`` is a
short fixed code (see :data:`REASONS`), suitable as a skip reason in a ledger.

- ``messages``: ``{"messages": [{"role", "content", "weight"?}, ...], "system"?}``
- ``sharegpt``: ``{"conversations": [{"from", "value"}, ...], "system"?}``, ``from``
  mapped by :data:`SHAREGPT_ROLES`
- ``alpaca``: ``{"instruction", "input"?, "output", "system"?, "history"?}``: user =
  instruction, plus ``"\\n\\n" + input`` when input is a non-empty string;
  assistant = output; ``history``, ``[[instruction, output], ...]``, gives the
  turns before it

A record's ``system`` string (as LLaMA-Factory's ShareGPT, OpenAI-style and
Alpaca datasets carry it) is the system message; an empty one means none, and
one beside a system message of the record's own is ``role_order`` (two system
prompts). Other keys of a record or a message are ignored.

ChatML
------
Each message renders as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; a prompt
for generation ends with ``<|im_start|>assistant\\n``. :data:`CHAT_TEMPLATE_JINJA`
renders the same text for ``transformers``' ``apply_chat_template``.

This is the template of our own tokenizer; a model's own template (an adopted
Hugging Face tokenizer's, or a ``.jinja`` file) is rendered and labelled by
:mod:`pipeline.data.chat_template`, which falls back to the functions here for
ChatML on our tokenizer.

Tokenization matches what Hugging Face does with that template (special strings
split out as single ids, the text between them byte-level-BPE encoded as one
piece), with one deliberate difference: the special ids come only from the
template, never from content. A literal ``"<|im_end|>"`` inside a message is
encoded as ordinary bytes here, whereas ``apply_chat_template`` would turn it into
the special id. For content without special-token strings both give the same ids.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, NotRequired, Sequence, TypedDict

from tokenizers import Tokenizer

from pipeline.data.shards import IGNORE_INDEX
from pipeline.data.tokenizer import IM_END, IM_START, special_ids

Role = Literal["system", "user", "assistant"]
ROLES: tuple[str, ...] = ("system", "user", "assistant")


class Message(TypedDict):
    role: Role
    content: str
    weight: NotRequired[int]  # 0: an assistant message kept as context, not trained


# Skip reasons a converter can give; fixed codes so that counts group well.
REASONS: dict[str, str] = {
    "not_an_object": "the record is not a JSON object",
    "unknown_format": "auto could not tell the format from the record's keys",
    "ambiguous_format": "the record has the keys of more than one format",
    "missing_key": "a required key is absent",
    "bad_type": "a value has the wrong type",
    "unknown_role": "a role (or sharegpt 'from') outside the known set",
    "empty_content": "a message whose content is empty or only whitespace and invisible characters",
    "non_utf8": "text with no UTF-8 form: a lone surrogate, as a JSON escape like \\ud800 gives",
    "empty_conversation": "no messages at all",
    "role_order": "system not first, or user/assistant not alternating from user",
    "no_assistant": "no assistant message (or only ones of weight 0), so nothing to learn",
    "last_not_assistant": "a training example must end with an assistant message",
}


class ChatFormatError(ValueError):
    """A record cannot be turned into a valid conversation. ``reason`` is a key of
    :data:`REASONS`; ``detail`` says where and what."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


# --- validation ------------------------------------------------------------------------------

# Characters that show nothing: control (Cc) and format (Cf: zero-width space, joiners, BOM, soft hyphen).
_INVISIBLE = ("Cc", "Cf")


def blank(text: str) -> bool:
    """True when ``text`` shows nothing: empty, or only whitespace and invisible
    characters (a reply of one zero-width space would teach the model to say nothing)."""
    return all(c.isspace() or unicodedata.category(c) in _INVISIBLE for c in text)


def validate_messages(messages: Sequence[Mapping[str, Any]], complete: bool = True) -> None:
    """Check the internal form and the order rules of the module docstring.
    ``complete=False`` (prompts) allows any last message. Raises ChatFormatError."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatFormatError("bad_type", f"messages: expected a list, got {type(messages).__name__}")
    if not messages:
        raise ChatFormatError("empty_conversation")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatFormatError("bad_type", f"message {i}: expected an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ChatFormatError("unknown_role", f"message {i}: role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ChatFormatError("bad_type", f"message {i}: content must be a string, got {type(content).__name__}")
        if blank(content):
            raise ChatFormatError("empty_content", f"message {i} ({role})")
        if not content.isascii():
            try:
                content.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ChatFormatError("non_utf8", f"message {i} ({role}): a lone surrogate "
                                                  f"U+{ord(content[e.start]):04X} at character {e.start}") from None
        if "weight" in m:
            _check_weight(m["weight"], role, f"message {i}")
    body = messages[1:] if messages[0]["role"] == "system" else messages
    for j, m in enumerate(body):
        want = "user" if j % 2 == 0 else "assistant"
        if m["role"] != want:
            i = j + len(messages) - len(body)
            raise ChatFormatError("role_order", f"message {i} is {m['role']!r}, expected {want!r}")
    if complete:
        if not any(m["role"] == "assistant" for m in messages):
            raise ChatFormatError("no_assistant")
        if not any(m["role"] == "assistant" and m.get("weight", 1) for m in messages):
            raise ChatFormatError("no_assistant", "every assistant message has weight 0")
        if messages[-1]["role"] != "assistant":
            raise ChatFormatError("last_not_assistant", f"last message is {messages[-1]['role']!r}")


def _check_weight(weight: Any, role: str, where: str) -> None:
    if type(weight) is not int or weight not in (0, 1):
        raise ChatFormatError("bad_type", f"{where}: weight {weight!r}; a weight is 0 or 1")
    if weight and role != "assistant":
        raise ChatFormatError("bad_type", f"{where}: weight 1 on a {role} message; only assistant messages are "
                                          "trained")


# --- converters ------------------------------------------------------------------------------


def _field(record: Mapping[str, Any], key: str, kind: type, where: str = "") -> Any:
    if key not in record or record[key] is None:
        raise ChatFormatError("missing_key", f"{where}{key!r}")
    value = record[key]
    if not isinstance(value, kind):
        raise ChatFormatError("bad_type", f"{where}{key!r}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _from_messages(record: Mapping[str, Any]) -> list[Message]:
    out: list[Message] = _system(record)
    for i, m in enumerate(_field(record, "messages", list)):
        if not isinstance(m, Mapping):
            raise ChatFormatError("bad_type", f"messages[{i}]: expected an object, got {type(m).__name__}")
        role = _field(m, "role", str, f"messages[{i}].")
        if role not in ROLES:
            raise ChatFormatError("unknown_role", f"messages[{i}]: role {role!r}; roles are {', '.join(ROLES)}")
        if out and role == "system" and i == 0:
            raise ChatFormatError("role_order", "a 'system' key and a system message first in messages: two system "
                                                "prompts")
        message: Message = {"role": role, "content": _field(m, "content", str, f"messages[{i}].")}
        if m.get("weight") is not None:
            _check_weight(m["weight"], role, f"messages[{i}]")
            if m["weight"] == 0 and role == "assistant":
                message["weight"] = 0
        out.append(message)
    return out


SHAREGPT_ROLES: dict[str, Role] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}


def _system(record: Mapping[str, Any]) -> list[Message]:
    """The system message of a record's ``system`` key (the datasets of every
    format in LLaMA-Factory's layout); none when it is absent, null or blank."""
    system = record.get("system")
    if system is None:
        return []
    if not isinstance(system, str):
        raise ChatFormatError("bad_type", f"'system': expected str, got {type(system).__name__}")
    return [] if blank(system) else [{"role": "system", "content": system}]


def _from_sharegpt(record: Mapping[str, Any]) -> list[Message]:
    out: list[Message] = _system(record)
    for i, turn in enumerate(_field(record, "conversations", list)):
        if not isinstance(turn, Mapping):
            raise ChatFormatError("bad_type", f"conversations[{i}]: expected an object, got {type(turn).__name__}")
        who = _field(turn, "from", str, f"conversations[{i}].")
        if who not in SHAREGPT_ROLES:
            raise ChatFormatError("unknown_role", f"conversations[{i}]: from {who!r}; known: {', '.join(SHAREGPT_ROLES)}")
        if out and SHAREGPT_ROLES[who] == "system" and i == 0:
            raise ChatFormatError("role_order", "a 'system' key and a system turn first in conversations: two "
                                                "system prompts")
        out.append({"role": SHAREGPT_ROLES[who], "content": _field(turn, "value", str, f"conversations[{i}].")})
    return out


def _from_alpaca(record: Mapping[str, Any]) -> list[Message]:
    instruction = _field(record, "instruction", str)
    output = _field(record, "output", str)
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise ChatFormatError("bad_type", f"'input': expected str, got {type(extra).__name__}")
    # An instruction that is blank makes a blank user turn even when input is set:
    # check it on its own so the reason names the real problem.
    if blank(instruction):
        raise ChatFormatError("empty_content", "'instruction'")
    user = instruction + ("" if extra is None or blank(extra) else "\n\n" + extra)
    earlier: list[Message] = []
    history = record.get("history")
    if history is not None:
        if not isinstance(history, list):
            raise ChatFormatError("bad_type", f"'history': expected a list of [instruction, output], got "
                                              f"{type(history).__name__}")
        for i, pair in enumerate(history):
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
                raise ChatFormatError("bad_type", f"history[{i}]: expected [instruction, output], two strings")
            earlier += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return [*_system(record), *earlier, {"role": "user", "content": user}, {"role": "assistant", "content": output}]


@dataclass(frozen=True)
class ChatFormat:
    """An input format: the key whose presence identifies it (for ``auto``) and
    its converter (record -> messages, raising ChatFormatError)."""

    key: str
    convert: Callable[[Mapping[str, Any]], list[Message]]


FORMATS: dict[str, ChatFormat] = {
    "messages": ChatFormat("messages", _from_messages),
    "sharegpt": ChatFormat("conversations", _from_sharegpt),
    "alpaca": ChatFormat("instruction", _from_alpaca),
}
FORMAT_NAMES: tuple[str, ...] = ("auto", *FORMATS)


def detect_format(record: Mapping[str, Any]) -> str:
    """The name of the one format whose key the record has. Raises ChatFormatError
    (``unknown_format`` or ``ambiguous_format``)."""
    found = [name for name, f in FORMATS.items() if f.key in record]
    if not found:
        keys = ", ".join(sorted(map(str, record)))[:200]
        raise ChatFormatError("unknown_format", f"keys: {keys or '(none)'}; expected one of "
                              + ", ".join(repr(f.key) for f in FORMATS.values()))
    if len(found) > 1:
        raise ChatFormatError("ambiguous_format", f"keys of {', '.join(found)}")
    return found[0]


def to_messages(record: Any, fmt: str = "auto") -> list[Message]:
    """Convert one record of format ``fmt`` (a key of :data:`FORMATS`, or ``auto``)
    to a validated complete conversation. Raises ChatFormatError; a ``fmt`` that is
    not a format name is a programming error (KeyError)."""
    if not isinstance(record, Mapping):
        raise ChatFormatError("not_an_object", f"got {type(record).__name__}")
    name = detect_format(record) if fmt == "auto" else fmt
    messages = FORMATS[name].convert(record)
    validate_messages(messages, complete=True)
    return messages


# --- ChatML ----------------------------------------------------------------------------------

# The same text as render_chat. Written on one line with no literal newlines, so it
# renders identically whatever the Jinja whitespace options (transformers turns on
# trim_blocks and lstrip_blocks).
CHAT_TEMPLATE_JINJA = (
    "{%- for message in messages %}"
    "{{ '" + IM_START + "' + message['role'] + '\\n' + message['content'] + '" + IM_END + "' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '" + IM_START + "assistant\\n' }}{%- endif %}"
)


def render_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
    """The ChatML text of ``messages`` (not validated: this is only the template)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def _encode(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
            ) -> tuple[list[int], list[int]]:
    ids_of = special_ids(tokenizer)
    im_start, im_end = ids_of["im_start"], ids_of["im_end"]
    # The rendered text splits at special tokens into: per message "{role}\n{content}",
    # and "\n" after each <|im_end|>; Hugging Face encodes each piece on its own, so
    # encoding them here piece by piece gives the same ids. Parsing of special strings
    # is switched off for the call so that content cannot produce a special id.
    saved = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        newline = tokenizer.encode("\n", add_special_tokens=False).ids
        ids: list[int] = []
        labels: list[int] = []
        for m in messages:
            head = f"{m['role']}\n"
            enc = tokenizer.encode(head + m["content"], add_special_tokens=False)
            ids.append(im_start)
            ids.extend(enc.ids)
            ids.append(im_end)
            ids.extend(newline)
            if m["role"] == "assistant" and m.get("weight", 1):
                # A token is the assistant's if any of its characters are content. Only
                # when content starts with whitespace can a token straddle the header's
                # "\n" and the content; it is then labelled, as it carries content.
                body = [t if end > len(head) else IGNORE_INDEX for t, (_, end) in zip(enc.ids, enc.offsets)]
                labels.append(IGNORE_INDEX)
                labels.extend(body)
                labels.append(im_end)
            else:
                labels.extend([IGNORE_INDEX] * (len(enc.ids) + 2))
            labels.extend([IGNORE_INDEX] * len(newline))
        if add_generation_prompt:
            ids.append(im_start)
            ids.extend(tokenizer.encode("assistant\n", add_special_tokens=False).ids)
    finally:
        tokenizer.encode_special_tokens = saved
    return ids, labels


def encode_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of the ChatML rendering of a complete conversation, and labels of
    the same length: the id where the token is assistant content or the
    ``<|im_end|>`` closing an assistant turn, ``IGNORE_INDEX`` (-100) elsewhere
    (system and user turns, every ``<|im_start|>``, the header ``assistant\\n``, the
    ``\\n`` after each ``<|im_end|>``, assistant turns of weight 0). Labels are aligned
    with ids (label ``i`` is for token ``i``); the training loader shifts them.

    Raises ChatFormatError if ``messages`` break the rules of the module docstring,
    and TokenizerError if the tokenizer lacks our special ids. The tokenizer's
    ``encode_special_tokens`` flag is set for the call and restored after.
    """
    validate_messages(messages, complete=True)
    return _encode(tokenizer, messages, add_generation_prompt=False)


def encode_prompt(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]],
                  add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the ChatML rendering of ``messages`` for generation, ending with
    ``<|im_start|>assistant\\n`` when ``add_generation_prompt``. The messages may
    end with any role. Raises ChatFormatError / TokenizerError like encode_chat."""
    validate_messages(messages, complete=False)
    return _encode(tokenizer, messages, add_generation_prompt)[0]
