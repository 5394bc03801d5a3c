"""A model's own chat template: render conversations the way transformers does,
and find what the assistant wrote so that only that is trained.

Choosing the template
---------------------
:func:`load_chat_template` takes ``auto``, ``chatml`` or the path of a ``.jinja``
file. ``auto`` is the tokenizer's own template (``specials.json``, written when a
Hugging Face tokenizer is adopted) when it has one, else ChatML. ChatML on our
own tokenizer keeps the hand-written path of :mod:`pipeline.data.chat`
(``ChatTemplate.source is None``), which gives the same ids and labels as the
general path below, and byte for byte the SFT data of before.

Rendering
---------
Templates are compiled by transformers' own chat-template machinery
(``transformers.utils.chat_template_utils``: a sandboxed jinja2 environment with
``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``strftime_now``,
``tojson``, ``namespace``) and get the variables ``apply_chat_template`` passes:
``messages``, ``tools=None``, ``documents=None``, ``add_generation_prompt`` and
the tokenizer's special-token texts (``bos_token``, ``eos_token``, ...). One
difference, for reproducible data: ``strftime_now`` reads the pinned
``ChatTemplate.date`` instead of the clock (Llama 3.x puts "Today Date" in every
system block).

Locating the assistant's text
-----------------------------
Real templates (Qwen2.5, Qwen3, Llama 3.x, Mistral) carry no ``{% generation %}``
markers, so the spans are found by rendering, and verified:

1. The conversation's *shape* (its roles) is rendered with a unique placeholder
   in place of each message's content. Each assistant content must appear
   exactly once, in order; other contents may appear any number of times (a
   template may drop or repeat the system prompt). This splits the render into
   template text and content slots, and is cached per shape.
2. The real conversation is rendered and must equal that template text with each
   content put back as it is, or with whitespace stripped at its edges (Llama's
   ``| trim``, Qwen3's ``lstrip('\\n')``). Anything else (a template that
   upper-cases, drops or rewrites content, or branches on it) means the spans are
   not known: see "Failures".
3. The assistant's text of turn ``i`` begins where the template's generation
   prompt for ``messages[:i]`` ends (rendered with ``add_generation_prompt=True``;
   it must be a prefix of the full render). So the role header is never trained,
   and whatever the template writes between the header and the content is the
   assistant's: Mistral's ``" "``, and Qwen3's empty think block
   ``"<think>\\n\\n</think>\\n\\n"`` before the last reply, which teaches the model
   to answer without reasoning, as the data does.
4. It ends after the first special token the template writes after the content,
   the end of turn: ``<|im_end|>`` (Qwen, ChatML), ``<|eot_id|>`` (Llama 3),
   ``</s>`` (Mistral). The text between the content and that token (none, in
   these families) is the assistant's too. What follows (Qwen's ``"\\n"``, the next
   header) is not.

A token is labelled when any of its characters lie in an assistant span (the
rule of the ChatML path: only a token that joins header whitespace to content
whitespace straddles the start). The last labelled token of every turn is
checked to be the end-of-turn token's id.

Example, Llama 3.x, trained text in brackets::

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge
    Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n<|eot_id|><|start_header_id|>
    user<|end_header_id|>\\n\\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>
    \\n\\n[Hello!<|eot_id|>]

Qwen3 reasoning. Qwen3's template moves ``<think>…</think>`` out of an assistant
content: it keeps it in the turns after the last user message and removes it
from earlier ones. That is a rewrite of the content, so such a conversation is
skipped (``template_rewrites_content``), counted, not trained half-understood.

Tokenization
------------
Special tokens come only from the template's text, never from content: content
holding ``"<|im_end|>"`` encodes as ordinary bytes. When no content holds a
special-token string the whole render is encoded in one call, as
``apply_chat_template(tokenize=True)`` does, so the ids are the same. Otherwise
the render is split at the template's special tokens and the text between them
is encoded with special-token matching off. (Non-special added tokens, such as
Qwen's ``<tool_call>`` or ``<think>``, are vocabulary words and match anywhere,
as in transformers.) Decoding the ids must give back the render exactly.

Failures
--------
A template whose spans cannot be located (content not rendered verbatim, no
special token closing an assistant turn, a generation prompt that is not a
prefix of the render) raises :class:`ChatTemplateError`, one line naming the
template and why; :func:`check_template` tries it on probe conversations before
any data is read. A single conversation that the template rejects
(``raise_exception``, e.g. no system role) or fails on (e.g. a TypeError in the
template), rewrites, or whose text does not survive encode/decode (e.g. a
normalizer) raises :class:`TemplateSkip` with a fixed reason, which SFT counts
and quarantines.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from tokenizers import Tokenizer

from pipeline.data.chat import CHAT_TEMPLATE_JINJA, IGNORE_INDEX, encode_chat as chatml_encode_chat
from pipeline.data.chat import encode_prompt as chatml_encode_prompt
from pipeline.data.chat import validate_messages
from pipeline.data.tokenizer import (HF_DIR, IM_END, IM_START, OWN_TOKEN_VARIABLES, Specials, hf_specials,
                                     load_specials, missing_chatml_tokens, read_folder_json, tokenizer_dir)
from pipeline.errors import StageError

CHOICES = ("auto", "chatml")  # or the path of a .jinja file
# The date templates read as today: the Llama 3.1 template's own fallback.
DEFAULT_DATE = dt.date(2024, 7, 26)
# The variables apply_chat_template passes from the tokenizer (its special_tokens_map).
TOKEN_VARIABLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

TEMPLATE_REASONS: dict[str, str] = {
    "template_error": "the chat template refused the conversation (raise_exception, e.g. no system role) or "
                      "failed on it (e.g. a TypeError in the template)",
    "template_rewrites_content": "the chat template changes a message's content beyond trimming whitespace "
                                 "(e.g. Qwen3 moving <think> reasoning), so its spans are not known",
    "no_roundtrip": "decoding the tokens does not give back the rendered text (e.g. a normalizer)",
}


class ChatTemplateError(StageError):
    """The template cannot be used: its assistant spans cannot be located, or the
    choice names no usable template. One line naming the template and why."""


class TemplateSkip(ValueError):
    """One conversation cannot be encoded with the template; ``reason`` is a key of
    :data:`TEMPLATE_REASONS`."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in TEMPLATE_REASONS, reason
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass
class ChatTemplate:
    """A chat template and what rendering and encoding with it need.

    name       says where it came from, for messages: ``chatml``, ``tokenizer (<source>)`` or the file
    source     the jinja text; None: ChatML on our own tokenizer, by :mod:`pipeline.data.chat`
    variables  template variables from the tokenizer (``bos_token``, ``eos_token``, ...)
    specials   text -> id of the tokenizer's special tokens (never produced from content)
    date       what ``strftime_now`` reads as today
    """

    name: str
    source: str | None
    variables: dict[str, str] = field(default_factory=dict)
    specials: dict[str, int] = field(default_factory=dict)
    date: dt.date = DEFAULT_DATE
    special_re: re.Pattern = field(init=False, repr=False, compare=False)
    _layouts: dict[tuple, "_Layout"] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Longest first, so that a token wins over another that is its prefix.
        self.special_re = re.compile("|".join(re.escape(t) for t in sorted(self.specials, key=len, reverse=True))
                                     or "(?!)")

    @property
    def text(self) -> str:
        """The jinja text (ChatML's for the built-in path), as a model folder would ship it."""
        return CHAT_TEMPLATE_JINJA if self.source is None else self.source


# --- choosing --------------------------------------------------------------------------------


def tokenizer_specials(tok: Tokenizer) -> dict[str, int]:
    """Text -> id of the tokenizer's special added tokens (those that ordinary text
    must never encode to)."""
    return {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}


def _token_variables(folder: Path, roles: Specials, tok: Tokenizer) -> dict[str, str]:
    """The special-token texts apply_chat_template would pass: for our own
    tokenizer, those its export declares; from the adopted folder's
    ``tokenizer_config.json`` when there is one; else from the roles."""
    if roles.own:
        return dict(OWN_TOKEN_VARIABLES)
    config_file = folder / HF_DIR / "tokenizer_config.json"
    if config_file.is_file():
        return _config_variables(config_file)
    out = {"eos_token": roles.texts.get("eos") or tok.id_to_token(roles.eos_ids[0])} if roles.eos_ids else {}
    if roles.bos_id is not None:
        out["bos_token"] = tok.id_to_token(roles.bos_id)
    if roles.texts.get("pad"):
        out["pad_token"] = roles.texts["pad"]
    return {k: v for k, v in out.items() if v}


def _config_variables(config_file: Path) -> dict[str, str]:
    """The special-token texts a ``tokenizer_config.json`` names (a string or an
    AddedToken dict each), as apply_chat_template passes them to a template.
    A file that does not parse is a one-line TokenizerError naming it."""
    config = read_folder_json(config_file)
    out = {}
    for key in TOKEN_VARIABLES:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            out[key] = value
    return out


def load_chat_template(choice: str, tokenizer_path: str | Path, tok: Tokenizer, date: dt.date = DEFAULT_DATE,
                       key: str = "sft.data.chat_template") -> ChatTemplate:
    """The template named by ``choice`` (``auto``, ``chatml`` or a ``.jinja`` file)
    for the tokenizer at ``tokenizer_path`` (its folder or ``tokenizer.json``).
    Raises ChatTemplateError, naming ``key``, for a missing file or ChatML on a
    tokenizer without ChatML's tokens."""
    folder = tokenizer_dir(tokenizer_path)
    roles = load_specials(folder)
    specials = tokenizer_specials(tok)
    variables = _token_variables(folder, roles, tok)
    if choice == "auto" and roles.chat_template:
        return ChatTemplate(f"tokenizer ({roles.source})", roles.chat_template, variables, specials, date)
    if choice in CHOICES:
        if roles.own:
            return ChatTemplate("chatml", None, variables, specials, date)
        missing = missing_chatml_tokens(tok)
        if missing:
            raise ChatTemplateError(
                f"{key}: {choice} means ChatML, but the tokenizer adopted from {roles.source} has no "
                f"special token {' or '.join(missing)}" + (" and no chat template of its own" if choice == "auto"
                                                           else "") + "; give the path of a .jinja template")
        return ChatTemplate("chatml", CHAT_TEMPLATE_JINJA, variables, specials, date)
    path = Path(choice).expanduser()
    if not path.is_file():
        raise ChatTemplateError(f"{key}: {choice!r} is neither auto, chatml nor an existing .jinja file")
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{key}: cannot read {path}: {e}") from e
    return ChatTemplate(str(path), source, variables, specials, date)


def template_of_sft_data(manifest: Mapping[str, Any], tokenizer_path: str | Path, tok: Tokenizer) -> ChatTemplate:
    """The template the SFT data (``data/sft/manifest.json``) was rendered with,
    so that prompts at evaluation and generation are rendered the same way.
    A manifest written before templates were recorded means ChatML."""
    name = manifest.get("chat_template_name", "chatml")
    date = dt.date.fromisoformat(manifest["template_date"]) if manifest.get("template_date") else DEFAULT_DATE
    folder = tokenizer_dir(tokenizer_path)
    roles = load_specials(folder)
    variables = _token_variables(folder, roles, tok)
    source = None if name == "chatml" and roles.own else manifest.get("chat_template") or CHAT_TEMPLATE_JINJA
    return ChatTemplate(name, source, variables, tokenizer_specials(tok), date)


def template_of_hf_folder(folder: str | Path, tok: Tokenizer, date: dt.date = DEFAULT_DATE
                          ) -> tuple[ChatTemplate | None, Specials]:
    """The chat template and token roles of a Hugging Face model folder (an export
    of ours or a published model), read as transformers reads them. As
    ``auto`` chooses for SFT (:func:`load_chat_template`): the folder's own
    template, else ChatML with the folder's own ``<|im_start|>``/``<|im_end|>``
    ids when its tokenizer has them as special tokens, else None (the folder
    cannot be prompted as a chat)."""
    folder = Path(folder)
    roles = hf_specials(folder, tok)
    variables = _config_variables(folder / "tokenizer_config.json")
    if roles.chat_template:
        name, source = f"tokenizer ({folder})", roles.chat_template
    elif not missing_chatml_tokens(tok):
        name, source = "chatml", CHAT_TEMPLATE_JINJA
    else:
        return None, roles
    return ChatTemplate(name, source, variables, tokenizer_specials(tok), date), roles


# --- rendering -------------------------------------------------------------------------------


def _compiled(source: str) -> Any:
    """The template compiled in transformers' own environment (cached there)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError as e:  # transformers is what renders model templates, as it does for the model's users
        raise ChatTemplateError(f"rendering a model's chat template needs transformers and jinja2>=3.1.6: {e}") from e
    return _compile_jinja_template(source)


def render(template: ChatTemplate, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
    """The template's text for ``messages``, as ``apply_chat_template(tokenize=False)``
    gives it (with ``strftime_now`` pinned to ``template.date``). Raises
    ChatTemplateError when the template does not compile, TemplateSkip
    (``template_error``) when it refuses the conversation."""
    import jinja2

    try:
        compiled = _compiled(template.text)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template {template.name} does not compile: {e}") from e
    day = dt.datetime.combine(template.date, dt.time())
    try:
        return compiled.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **template.variables,
                               strftime_now=day.strftime)
    except jinja2.TemplateError as e:
        raise TemplateSkip("template_error", f"{template.name}: {_one_line(e)}") from e
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError) as e:
        # A template's own bug on this conversation ("{{ content + 1 }}", a range past the
        # sandbox's MAX_RANGE, an include without a loader): jinja lets Python's error through.
        raise TemplateSkip("template_error", f"{template.name}: {type(e).__name__}: {_one_line(e)}") from e


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


# --- locating contents and assistant spans ----------------------------------------------------

_PLACEHOLDER = "Sentinel{}Zq"  # mixed case and no edge whitespace: trimming keeps it, case changes do not
_PLACEHOLDER_RE = re.compile(r"Sentinel(\d+)Zq")


@dataclass(frozen=True)
class _Layout:
    """The render of one conversation shape: ``pieces`` alternate template text
    (even indices) and the index of the message whose content goes there (odd),
    starting and ending with text. ``spans`` holds, per assistant turn, where its
    text starts and ends as ``(piece, offset)`` in template pieces."""

    pieces: tuple[str | int, ...]
    spans: tuple[tuple[tuple[int, int], tuple[int, int]], ...] = ()
    end_tokens: tuple[str, ...] = ()


def _fail(template: ChatTemplate, why: str) -> ChatTemplateError:
    chatml = IM_START in template.specials and IM_END in template.specials  # else chatml is refused in turn
    fix = ("set sft.data.chat_template to chatml or a .jinja file" if chatml else
           "set sft.data.chat_template to a .jinja file: this tokenizer has no ChatML tokens, so chatml would not do")
    return ChatTemplateError(f"chat template {template.name}: {why}, so what the assistant wrote cannot be located "
                             f"({fix})")


def _split(text: str) -> list[str | int]:
    pieces: list[str | int] = []
    pos = 0
    for m in _PLACEHOLDER_RE.finditer(text):
        pieces += [text[pos:m.start()], int(m.group(1))]
        pos = m.end()
    return pieces + [text[pos:]]


def _piece_at(pieces: Sequence[str | int], starts: Sequence[int], x: int) -> tuple[int, int] | None:
    """``(piece, offset)`` of position ``x`` of the placeholder render, in template
    text (a boundary belongs to the text beside it); None inside a placeholder."""
    for j in range(0, len(pieces), 2):
        if starts[j] <= x <= starts[j] + len(pieces[j]):  # type: ignore[arg-type]
            return j, x - starts[j]
    return None


def _layout(template: ChatTemplate, roles: tuple[str, ...], add_generation_prompt: bool, spans: bool) -> _Layout:
    """The layout of a conversation with these roles (cached per shape)."""
    key = (roles, add_generation_prompt, spans)
    if key in template._layouts:
        return template._layouts[key]
    placeholders = [{"role": r, "content": _PLACEHOLDER.format(i)} for i, r in enumerate(roles)]
    text = render(template, placeholders, add_generation_prompt)
    pieces = _split(text)
    slots = list(pieces[1::2])
    if any(not 0 <= s < len(roles) for s in slots):
        raise _fail(template, "it renders text that looks like a content placeholder")
    assistants = [i for i, r in enumerate(roles) if r == "assistant"]
    if not spans:
        layout = _Layout(tuple(pieces))
        template._layouts[key] = layout
        return layout
    for i in assistants:
        if slots.count(i) != 1:
            raise _fail(template, f"the content of assistant message {i} appears {slots.count(i)} times in the "
                                  f"render instead of once, verbatim")
    if [s for s in slots if roles[s] == "assistant"] != assistants:
        raise _fail(template, "it renders assistant messages out of order")
    starts, pos = [], 0
    for p in pieces:
        starts.append(pos)
        pos += len(p) if isinstance(p, str) else len(_PLACEHOLDER.format(p))
    found, ends = [], []
    for i in assistants:
        slot = 1 + 2 * slots.index(i)
        prompt = render(template, placeholders[:i], add_generation_prompt=True)
        if not text.startswith(prompt) or len(prompt) > starts[slot]:
            raise _fail(template, f"its generation prompt for message {i} is not the start of the assistant turn in "
                                  "the full render")
        begin = _piece_at(pieces, starts, len(prompt))
        if begin is None or any(isinstance(p, int) for p in pieces[begin[0]:slot]):
            raise _fail(template, f"other content lies between the generation prompt and assistant message {i}")
        after = pieces[slot + 1]
        m = template.special_re.search(after)  # type: ignore[arg-type]
        if m is None:
            raise _fail(template, f"no special token closes assistant message {i} (after its content comes "
                                  f"{after[:40]!r})")
        found.append((begin, (slot + 1, m.end())))
        ends.append(m.group())
    layout = _Layout(tuple(pieces), tuple(found), tuple(ends))
    template._layouts[key] = layout
    return layout


def _trimmed(content: str) -> list[str]:
    """The content and its edge-whitespace trims a template may render (``trim``,
    ``strip('\\n')``, ``lstrip``, ...), longest first."""
    lead = [0, len(content) - len(content.lstrip()), len(content) - len(content.lstrip("\n"))]
    trail = [0, len(content) - len(content.rstrip()), len(content) - len(content.rstrip("\n"))]
    out = dict.fromkeys(content[i:len(content) - j] for i in sorted(set(lead)) for j in sorted(set(trail)))
    return sorted(out, key=len, reverse=True)


def _match(template: ChatTemplate, layout: _Layout, text: str, messages: Sequence[Mapping[str, str]]
           ) -> tuple[list[int], list[tuple[int, int]]]:
    """Where each piece of ``layout`` starts in the real render ``text``, and the
    character span of every content slot. Raises TemplateSkip when ``text`` is
    not the layout's text with the contents (or their trims) put in."""
    starts: list[int] = []
    contents: list[tuple[int, int]] = []
    pos = 0
    pieces = layout.pieces
    for j, piece in enumerate(pieces):
        starts.append(pos)
        if isinstance(piece, str):
            if not text.startswith(piece, pos):
                raise TemplateSkip("template_rewrites_content", f"{template.name}: the render differs from its "
                                   f"template text at character {pos}")
            pos += len(piece)
            continue
        follow = pieces[j + 1]
        for p in _trimmed(messages[piece]["content"]):
            if text.startswith(p + follow, pos):  # type: ignore[operator]
                contents.append((pos, pos + len(p)))
                pos += len(p)
                break
        else:
            raise TemplateSkip("template_rewrites_content", f"{template.name}: message {piece} "
                               f"({messages[piece]['role']}) is not rendered as its content")
    if pos != len(text):
        raise TemplateSkip("template_rewrites_content", f"{template.name}: the render has text past its template")
    return starts, contents


# --- encoding --------------------------------------------------------------------------------


def _encode_text(tok: Tokenizer, template: ChatTemplate, text: str, contents: Sequence[tuple[int, int]]
                 ) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character offsets of ``text``, special tokens taken only outside
    the ``contents`` spans (see the module docstring)."""
    special_re = template.special_re
    saved = tok.encode_special_tokens
    try:
        if not any(special_re.search(text, a, b) for a, b in contents):
            tok.encode_special_tokens = False  # the whole render, as apply_chat_template encodes it
            enc = tok.encode(text, add_special_tokens=False)
            return list(enc.ids), list(enc.offsets)
        # Cut the render at the special tokens of its template text; encode the runs between
        # them with special-token matching off, so content stays text.
        cuts: list[tuple[int, int]] = []
        inside = sorted(contents)
        for m in special_re.finditer(text):
            if not any(a < m.end() and m.start() < b for a, b in inside):
                cuts.append((m.start(), m.end()))
        tok.encode_special_tokens = True
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        pos = 0
        for a, b in [*cuts, (len(text), len(text))]:
            if a > pos:
                enc = tok.encode(text[pos:a], add_special_tokens=False)
                ids += enc.ids
                offsets += [(s + pos, e + pos) for s, e in enc.offsets]
            if b > a:
                ids.append(template.specials[text[a:b]])
                offsets.append((a, b))
            pos = b
        return ids, offsets
    finally:
        tok.encode_special_tokens = saved


def _check_roundtrip(tok: Tokenizer, ids: list[int], text: str) -> None:
    back = tok.decode(ids, skip_special_tokens=False)
    if back != text:
        at = next((i for i, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
        raise TemplateSkip("no_roundtrip", f"decoding gives {back[max(0, at - 15):at + 15]!r} for "
                           f"{text[max(0, at - 15):at + 15]!r} (character {at})")


def encode_conversation(tok: Tokenizer, messages: Sequence[Mapping[str, str]], template: ChatTemplate
                        ) -> tuple[list[int], list[int]]:
    """Token ids of a complete conversation rendered with ``template``, and labels
    of the same length: the id where the token is the assistant's (module
    docstring) in a turn of weight 1, ``IGNORE_INDEX`` elsewhere. Raises ChatFormatError for messages
    that break :func:`pipeline.data.chat.validate_messages`, TemplateSkip for a
    conversation the template rejects or rewrites or that does not round-trip,
    ChatTemplateError when the template's spans cannot be located."""
    if template.source is None:
        return chatml_encode_chat(tok, messages)
    validate_messages(messages, complete=True)
    roles = tuple(m["role"] for m in messages)
    layout = _layout(template, roles, add_generation_prompt=False, spans=True)
    text = render(template, messages)
    starts, contents = _match(template, layout, text, messages)
    ids, offsets = _encode_text(tok, template, text, contents)
    spans = [(starts[a] + i, starts[b] + k) for (a, i), (b, k) in layout.spans]
    labels = [IGNORE_INDEX] * len(ids)
    weights = [m.get("weight", 1) for m in messages if m["role"] == "assistant"]
    t = 0
    for (a, b), end_token, weight in zip(spans, layout.end_tokens, weights):
        while t < len(ids) and offsets[t][1] <= a:
            t += 1
        last = None
        while t < len(ids) and offsets[t][0] < b:
            if weight:  # weight 0: context, not trained (pipeline.data.chat)
                labels[t] = ids[t]
            last = t
            t += 1
        if last is None or ids[last] != template.specials[end_token]:
            raise _fail(template, f"the end-of-turn token {end_token!r} does not encode as its own token at the "
                                  "end of an assistant turn")
    _check_roundtrip(tok, ids, text)
    return ids, labels


def encode_prompt(tok: Tokenizer, messages: Sequence[Mapping[str, str]], template: ChatTemplate | None = None,
                  add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` (any last role) rendered with ``template`` for
    generation, ending with its generation prompt when ``add_generation_prompt``.
    ``template=None`` is ChatML on our own tokenizer. Special tokens come only
    from the template (content that holds a special-token string must then be
    located in the render, else ChatTemplateError). Raises ChatFormatError for
    invalid messages and TemplateSkip when the template refuses them."""
    if template is None or template.source is None:
        return chatml_encode_prompt(tok, messages, add_generation_prompt)
    validate_messages(messages, complete=False)
    text = render(template, messages, add_generation_prompt)
    contents: list[tuple[int, int]] = []
    if any(template.special_re.search(m["content"]) for m in messages):
        layout = _layout(template, tuple(m["role"] for m in messages), add_generation_prompt, spans=False)
        try:
            contents = _match(template, layout, text, messages)[1]
        except TemplateSkip as e:
            raise ChatTemplateError(f"a message holds a special-token string and {e}; it cannot be kept out of "
                                    "the special tokens") from e
    return _encode_text(tok, template, text, contents)[0]


# --- checking a template before use -----------------------------------------------------------

PROBES: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}),
    ({"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"}),  # ends in a letter
    ({"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"},
     {"role": "assistant", "content": "Rome."}),
)


def check_template(tok: Tokenizer, template: ChatTemplate) -> tuple[int, ...]:
    """Encode the probe conversations; return the ids that close assistant turns
    (the end-of-turn tokens, which generation should stop at). A template that
    refuses the system-prompt probe (no system role) is accepted: such
    conversations are then skipped one by one. Raises ChatTemplateError, one
    line, when the spans cannot be located or the probes do not survive."""
    if template.source is None:
        return (template.specials[IM_END],)
    ends: dict[int, None] = {}
    for n, probe in enumerate(PROBES):
        where = (f"the built-in probe conversation {n} ({', '.join(m['role'] for m in probe)}), tried before any "
                 "of your data")
        try:
            encode_conversation(tok, probe, template)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{e}; found on {where}") from None
        except TemplateSkip as e:
            if e.reason == "template_error" and probe[0]["role"] == "system":
                continue
            if e.reason == "no_roundtrip":
                raise ChatTemplateError(f"the tokenizer does not give back the text of chat template {template.name} "
                                        f"(on {where}: {e.detail}); SFT needs an exact round trip") from e
            raise _fail(template, f"on {where}: {e}") from e
        layout = _layout(template, tuple(m["role"] for m in probe), add_generation_prompt=False, spans=True)
        ends.update(dict.fromkeys(template.specials[t] for t in layout.end_tokens))
    return tuple(ends)


def stop_ids(tok: Tokenizer, template: ChatTemplate, eos_ids: Sequence[int]) -> tuple[int, ...]:
    """The ids generation should stop at: the template's end-of-turn ids
    (:func:`check_template`), then the tokenizer's ``eos_ids`` (Specials.eos_ids)."""
    return tuple(dict.fromkeys((*check_template(tok, template), *eos_ids)))
