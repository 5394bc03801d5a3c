"""Tiny Hugging Face tokenizer folders in the style of the families we import.

:func:`save_family_tokenizer` trains a byte-level BPE with ``tokenizers`` on a
small built-in corpus (or the given one), adds the family's special tokens and
writes the folder with transformers' ``save_pretrained``, so that it looks like
what the model repos ship, as transformers 5 writes it: ``tokenizer.json``,
``tokenizer_config.json`` (with the ``tokenizer_class`` the real repos name;
transformers 5 writes no ``special_tokens_map.json``), ``chat_template.jinja`` and,
where the real repos have one,
``generation_config.json`` with the family's stop ids.

The chat templates are written in each family's real style, as their model
folders ship them (no ``{% generation %}`` markers): Qwen2.5 with its default
system prompt, Qwen3 with think blocks and ``enable_thinking``, Llama 3.1/3.2
with the knowledge-cutoff system block and ``strftime_now``/``date_string``,
and Mistral's ``[INST]``. Tool branches are left out or shortened; nothing here
calls a tool.

Where the real tokenizers differ from the fixture: the vocabularies are tiny
(a few hundred merges, so every id fits a model with ``vocab_size`` 1024), the
special tokens of Qwen and Llama are appended after the learned vocabulary (as
in the real ones, where they sit past the BPE ids) and only a few of Llama's
reserved tokens are kept; Mistral's real tokenizer is SentencePiece-style
(Metaspace with byte fallback), here it is byte-level BPE with the same
special tokens at the same ids 0..4 (so its ``tokenizer_class`` stays
transformers' own; LlamaTokenizer would refuse a byte-level file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

FAMILIES = ("qwen2", "qwen3", "llama3", "mistral")

# --- chat templates, in the style each family's model folder ships -----------------------------

QWEN2_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Mistral-7B-Instruct style: the system prompt goes in front of the first user turn.
MISTRAL_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# --- families ----------------------------------------------------------------------------------

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
QWEN_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")


@dataclass(frozen=True)
class Family:
    """How one family's tokenizer folder looks.

    leading     special tokens given ids 0.. (before the learned vocabulary), as SentencePiece models have them
    specials    special tokens appended after the learned vocabulary
    added       non-special added tokens (matched in text, kept when decoding with skip_special_tokens)
    roles       tokenizer_config's bos/eos/pad/unk token texts
    generation  generation_config.json's token ids by text (None: the repos ship none for the tokenizer)
    """

    template: str
    pattern: str | None
    nfc: bool = False
    leading: tuple[str, ...] = ()
    specials: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    roles: dict[str, str | None] = field(default_factory=dict)
    generation: dict[str, object] | None = None
    bos_prefix: str | None = None  # the post-processor's begin-of-text (add_special_tokens=True)
    tokenizer_class: str | None = None  # as the real tokenizer_config.json names it (None: transformers' own)


FAMILY_SPECS: dict[str, Family] = {
    # Qwen2.5-*-Instruct
    "qwen2": Family(QWEN2_TEMPLATE, QWEN_PATTERN, nfc=True, specials=QWEN_SPECIALS, added=QWEN_TOOL_TOKENS,
                    roles={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                    generation={"bos_token_id": "<|endoftext|>", "pad_token_id": "<|endoftext|>",
                                "eos_token_id": ["<|im_end|>", "<|endoftext|>"]},
                    tokenizer_class="Qwen2Tokenizer"),
    # Qwen3 (hybrid thinking)
    "qwen3": Family(QWEN3_TEMPLATE, QWEN_PATTERN, nfc=True, specials=QWEN_SPECIALS,
                    added=QWEN_TOOL_TOKENS + ("<tool_response>", "</tool_response>", "<think>", "</think>"),
                    roles={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                    generation={"bos_token_id": "<|endoftext|>", "pad_token_id": "<|endoftext|>",
                                "eos_token_id": ["<|im_end|>", "<|endoftext|>"]},
                    tokenizer_class="Qwen2Tokenizer"),
    # Llama-3.1/3.2-*-Instruct
    "llama3": Family(LLAMA3_TEMPLATE, LLAMA3_PATTERN, specials=LLAMA3_SPECIALS,
                     roles={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                     generation={"bos_token_id": "<|begin_of_text|>",
                                 "eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]},
                     bos_prefix="<|begin_of_text|>", tokenizer_class="PreTrainedTokenizerFast"),
    # Mistral-7B-Instruct
    "mistral": Family(MISTRAL_TEMPLATE, None, leading=MISTRAL_SPECIALS,
                      roles={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
                      generation={"bos_token_id": "<s>", "eos_token_id": "</s>"}, bos_prefix="<s>"),
}

# Enough text that the few hundred merges are ordinary English, code and chat words.
CORPUS: tuple[str, ...] = (
    "You are a helpful assistant. The user asks a question and the assistant answers it.",
    "What is the capital of France? The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
    "Please write a short answer. Sure, here is a short answer with some code:\n\n```python\nx = 1\n```\n",
    "The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024.",
    "system user assistant think tool response function arguments name content role message",
    "naïve café — “quotes” ‘single’ … 日本語 中文 한국어 🎉",
)


def _train(spec: Family, corpus: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if spec.nfc:
        tok.normalizer = normalizers.NFC()
    if spec.pattern is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(spec.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(spec.leading),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.added])
    if spec.bos_prefix is not None:
        bos = (spec.bos_prefix, tok.token_to_id(spec.bos_prefix))
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]),
        ])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def save_family_tokenizer(family: str, folder: str | Path, *, corpus: list[str] | None = None,
                          vocab_size: int = 512) -> Path:
    """Write a tokenizer folder of ``family`` (one of :data:`FAMILIES`) to ``folder``
    and return it. ``vocab_size`` bounds the learned vocabulary (byte alphabet and
    merges); the family's special and added tokens come on top (at most ~30)."""
    from transformers import PreTrainedTokenizerFast

    spec = FAMILY_SPECS[family]
    folder = Path(folder)
    texts = list(CORPUS) * 4 + list(corpus or [])
    tok = _train(spec, texts, vocab_size)
    roles = {k: v for k, v in spec.roles.items() if v is not None}
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=spec.template, clean_up_tokenization_spaces=False,
                                 model_max_length=32768, **roles)
    hf.save_pretrained(str(folder))
    if spec.tokenizer_class is not None:
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["tokenizer_class"] = spec.tokenizer_class
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if spec.generation is not None:
        gen: dict[str, object] = {}
        for key, value in spec.generation.items():
            gen[key] = [tok.token_to_id(v) for v in value] if isinstance(value, list) else tok.token_to_id(value)
        (folder / "generation_config.json").write_text(json.dumps({**gen, "transformers_version": "4.45.0"}, indent=2)
                                                       + "\n")
    return folder


# --- SentencePiece-style tokenizers (a dummy prefix before every text) -------------------------

SENTENCEPIECE_SPECIALS = ("<unk>", "<s>", "</s>")


def sentencepiece_tokenizer(corpus: list[str] | None = None, *, vocab_size: int = 400,
                            metaspace: bool = False) -> Tokenizer:
    """A tiny tokenizer in the layout of Llama 2's and Mistral 7B v0.1's
    ``tokenizer.json`` (SentencePiece converted by transformers): ``<unk>``,
    ``<s>``, ``</s>`` at ids 0..2, the 256 byte-fallback tokens ``<0x00>``..
    ``<0xFF>``, then BPE pieces learned on :data:`CORPUS` (and ``corpus``) in
    which ``▁`` stands for a space, never spanning two words nor holding a
    newline (a newline is the byte token ``<0x0A>``, as in Llama 2's). Every
    text gets a dummy prefix ``▁``: from the normalizer ``Prepend("▁")`` +
    ``Replace(" ", "▁")`` (the legacy layout, no pre-tokenizer), or with
    ``metaspace`` from a ``Metaspace`` pre-tokenizer with ``prepend_scheme``
    "first". The decoder turns ``▁`` back into spaces and byte tokens into
    text, and strips the prefix's space, so a text round-trips. The
    post-processor puts ``<s>`` before every text (``add_special_tokens``)."""
    texts = [t.replace("\n", " ") for t in list(CORPUS) * 4 + list(corpus or [])]
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    learner.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                                           show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    vocab = {t: i for i, t in enumerate(SENTENCEPIECE_SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SENTENCEPIECE_SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok
