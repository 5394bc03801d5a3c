"""Text generation with a KV cache, and loading any of our model folders for it.

Library::

    model, tok, config = load_for_inference("models/export")   # or models/sft, models/pretrain
    new_ids = generate(model, tok.encode("def fibonacci(").ids, max_new_tokens=64,
                       temperature=0.8, top_k=50, top_p=0.95, seed=0, stop_ids=[EOT_ID])

Command line (prints only the completion)::

    python -m pipeline.model.generate --model models/export --prompt "def fibonacci("
    python -m pipeline.model.generate --model models/sft --chat "How do I reverse a list?" [--system "..."]
    python -m pipeline.model.generate --model models/export --interactive

Each ``--chat`` is one user turn; several are answered in order, each seeing the
earlier turns and replies. Raw ``--prompt`` completion stops at ``<|endoftext|>``,
chat replies at ``<|im_end|>`` (or ``<|endoftext|>``).

Decoding is batch size 1: one prefill of the prompt, then one token per step
from the cache. It stops after emitting a stop id (which is included in the
returned ids, so a caller can tell a finished answer from a cut one), after
``max_new_tokens``, or when the sequence reaches the model's ``max_seq_len``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Iterable, Iterator

import torch
from tokenizers import Tokenizer

from pipeline import layout
from pipeline.data.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    encode_prompt,
    load_chat_template,
    stop_ids,
    template_of_hf_folder,
    template_of_sft_data,
)
from pipeline.data.tokenizer import (EOT_ID, IM_END_ID, check_fits, check_trained_with, load_specials, load_tokenizer,
                                     open_hf_tokenizer)
from pipeline.errors import StageError
from pipeline.files import broken_links, read_stage_json, sha256_file
from pipeline.model import hf_adapter
from pipeline.model.transformer import KVCache, ModelConfig, Transformer
from pipeline.training import checkpoint as ckpt
from pipeline.training.distributed import pick_device

# Sampling defaults, shared by the CLI and the exported generation_config.json.
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 50
DEFAULT_TOP_P = 0.95

TEXT_STOP_IDS = (EOT_ID,)
CHAT_STOP_IDS = (IM_END_ID, EOT_ID)


# --------------------------------------------------------------------------- sampling


def sample_next(logits: torch.Tensor, temperature: float = DEFAULT_TEMPERATURE, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Choose the next token from ``logits`` (..., vocab); returns ids (...,) int64.

    temperature 0 is greedy (argmax; top_k and top_p are then irrelevant).
    Otherwise the logits are divided by ``temperature``, cut to the ``top_k``
    most likely tokens (None or 0: no cut), then to the nucleus: the smallest set
    of most likely tokens whose probabilities sum to at least ``top_p`` (None or
    1: no cut; the most likely token always stays), and one token is drawn with
    ``generator``, so a seeded generator gives the same draw every time.
    Raises ValueError for a temperature that is negative or not finite, a
    negative top_k or top_p outside (0, 1].
    """
    if not (math.isfinite(temperature) and temperature >= 0):  # nan reached torch.multinomial as a traceback
        raise ValueError(f"temperature must be a finite number >= 0 (got {temperature})")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (got {top_k})")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (got {top_p})")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits / temperature
    if not torch.isfinite(scaled).all():  # a tiny temperature overflowed float32: inf - inf made nan probabilities
        scaled = ((logits.double() - logits.amax(-1, keepdim=True)) / temperature).float()  # <= 0, the top at 0
    logits = scaled
    if top_k:
        kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p is not None and top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        # A token stays if the tokens ranked above it do not reach top_p yet; the
        # top token has nothing above it, so it always stays.
        mass_above = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_above >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    flat = probs.reshape(-1, probs.size(-1))  # multinomial takes 1-D or 2-D input
    # multinomial normalises, so the cut distributions need no renormalising
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def iter_generate(model: Transformer, prompt_ids: list[int], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                  temperature: float = DEFAULT_TEMPERATURE, top_k: int | None = DEFAULT_TOP_K,
                  top_p: float | None = DEFAULT_TOP_P, seed: int = 0,
                  stop_ids: Iterable[int] = ()) -> Iterator[int]:
    """Yield new token ids one at a time; see :func:`generate` for the contract."""
    prompt_ids = [int(t) for t in prompt_ids]
    max_len = model.config.max_seq_len
    if max_new_tokens < 0:  # would print nothing, as if the model had nothing to say
        raise ValueError(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one token")
    if len(prompt_ids) > max_len:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model reads at most {max_len}")
    budget = min(max_new_tokens, max_len - len(prompt_ids))  # every emitted token takes a position
    if budget <= 0:
        return
    stops = set(int(s) for s in stop_ids)
    param = next(model.parameters())
    generator = torch.Generator(device=param.device).manual_seed(seed)
    # The last emitted token is never fed back, so the cache needs one position less.
    cache = KVCache(model.config, 1, len(prompt_ids) + budget - 1, device=param.device, dtype=param.dtype)

    # Inference mode around each step, not around the loop: a `with` across a yield
    # left it on in the caller's code between tokens (and after a break, until the
    # generator was collected), where a training step then built no graph.
    @torch.inference_mode()
    def next_token(ids: list[int], start_pos: int) -> int:
        logits = model(torch.tensor([ids], device=param.device), cache=cache, start_pos=start_pos)  # (1, T, V)
        return int(sample_next(logits[0, -1], temperature, top_k, top_p, generator))

    token = next_token(prompt_ids, 0)  # prefill
    pos = len(prompt_ids)
    for step in range(budget):
        yield token
        if token in stops or step + 1 == budget:
            return
        token = next_token([token], pos)
        pos += 1


def generate(model: Transformer, prompt_ids: list[int], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
             temperature: float = DEFAULT_TEMPERATURE, top_k: int | None = DEFAULT_TOP_K,
             top_p: float | None = DEFAULT_TOP_P, seed: int = 0, stop_ids: Iterable[int] = ()) -> list[int]:
    """The new token ids that continue ``prompt_ids`` (not the prompt itself).

    Samples with :func:`sample_next` from a ``torch.Generator`` seeded with
    ``seed``: the same inputs give the same tokens on the same device. Stops
    after emitting any of ``stop_ids`` (the stop id is the last element), after
    ``max_new_tokens``, or when prompt + output reach ``model.config.max_seq_len``.
    Runs under inference mode; put the model in eval mode first.
    Raises ValueError for an empty prompt, one longer than max_seq_len, or a
    negative max_new_tokens.
    """
    return list(iter_generate(model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed, stop_ids=stop_ids))


# --------------------------------------------------------------------------- loading


def load_for_inference(path: str | Path, *, tokenizer_path: str | Path | None = None,
                       device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer, ModelConfig]:
    """(model in eval mode on ``device``, tokenizer, config) from any model folder.

    ``path`` is a Hugging Face model folder of a supported family (an export of
    ours, ``models/export``, or a published model; its own ``tokenizer.json``
    is used; see ``pipeline.model.hf_adapter.load_hf_model``), a training checkpoint folder (``models/sft``,
    ``models/pretrain``: its latest complete checkpoint), or one
    ``step-XXXXXXXX`` checkpoint. Checkpoints hold no tokenizer: it comes from
    ``tokenizer_path`` (default ``data/tokenizer/tokenizer.json``), and if the
    checkpoint recorded the sha256 of the tokenizer it was trained with, the two
    must agree. The tokenizer does not turn special-token strings in text into
    special ids (see ``pipeline.data.tokenizer.load_tokenizer``).

    Raises FileNotFoundError when ``path`` holds no model, ValueError for a
    mismatched tokenizer or an unsupported model (UnsupportedModelError), DeviceError
    for a ``device`` this machine does not have (checked first), and CheckpointError /
    RuntimeError for damaged or mismatched weights.
    """
    path = Path(path)
    device = pick_device(device) if isinstance(device, str) else device
    broken = broken_links(path)
    if broken:
        raise FileNotFoundError(f"{path}: {broken}")
    if hf_adapter.is_hf_model_folder(path):
        config, model = hf_adapter.load_hf_model(path)
        if tokenizer_path:
            tokenizer = load_tokenizer(Path(tokenizer_path))
        else:  # the folder's own tokenizer, whatever its special ids
            tokenizer = open_hf_tokenizer(path)
            tokenizer.encode_special_tokens = True
    else:
        checkpoint = ckpt.resolve(path)  # verified; a damaged newest one raises CheckpointError
        if checkpoint is None:
            raise FileNotFoundError(f"{path}: no Hugging Face model (config.json + model.safetensors or "
                                    "its index) and no complete checkpoint")
        meta = checkpoint.meta
        config = ckpt.model_config(checkpoint)
        model = Transformer(config)
        ckpt.load_model_weights(checkpoint, model)
        tok_path = Path(tokenizer_path) if tokenizer_path else layout.TOKENIZER_JSON
        tokenizer = load_tokenizer(tok_path)
        check_trained_with(tok_path, meta.get("tokenizer_sha256"), fix="pass the right --tokenizer")
    check_fits(tokenizer, config.vocab_size)
    return model.to(device).eval(), tokenizer, config


# --------------------------------------------------------------------------- prompting


def prompting(path: str | Path, tokenizer: Tokenizer, tokenizer_path: str | Path | None = None,
              sft_manifest: str | Path | None = layout.SFT_DATA / "manifest.json", chat: bool = True,
              ) -> tuple[ChatTemplate | None, tuple[int, ...], tuple[int, ...]]:
    """How to prompt the model at ``path``: (chat template, chat stop ids, text
    stop ids). A Hugging Face folder brings its own template and stop ids
    (``tokenizer_config.json``, ``generation_config.json``); one without a
    template is prompted in ChatML with its own ``<|im_start|>``/``<|im_end|>``
    ids, as SFT's ``chat_template: auto`` would train it, and when it has no
    such tokens either, ``chat`` (the caller will chat) raises
    ChatTemplateError, one line. A checkpoint folder
    is prompted as SFT trained and evaluate samples: with the template and stop
    ids of the SFT data (``sft_manifest``) when that data was tokenized with this
    tokenizer, else with the tokenizer folder's (its own template, else ChatML).
    The template is None for ChatML on our own tokenizer."""
    path = Path(path)
    hf_folder = hf_adapter.is_hf_model_folder(path)
    if hf_folder and not tokenizer_path:
        template, roles = template_of_hf_folder(path, tokenizer)
        text_stops = tuple(dict.fromkeys([roles.eot_id, *roles.eos_ids]))
        if template is None:
            if chat:
                raise ChatTemplateError(f"{path} has no chat template (and no <|im_start|>/<|im_end|> tokens for "
                                        "ChatML); use --prompt")
            return None, text_stops, text_stops  # raw completion only
        return template, stop_ids(tokenizer, template, roles.eos_ids), text_stops
    tok_path = Path(tokenizer_path) if tokenizer_path else layout.TOKENIZER_JSON
    roles = load_specials(tok_path)
    text_stops = TEXT_STOP_IDS if roles.own else tuple(dict.fromkeys([roles.eot_id, *roles.eos_ids]))
    manifest = read_stage_json(sft_manifest) if not hf_folder and sft_manifest and Path(sft_manifest).is_file() else {}
    if manifest.get("chat_template") and manifest.get("tokenizer_sha256") in (None, sha256_file(tok_path)):
        template = template_of_sft_data(manifest, tok_path, tokenizer)
        chat_stops = tuple(manifest.get("stop_ids") or stop_ids(tokenizer, template, roles.eos_ids))
        return (None if template.source is None else template), chat_stops, text_stops
    if roles.own:
        return None, CHAT_STOP_IDS, TEXT_STOP_IDS
    template = load_chat_template("auto", tok_path, tokenizer, key="--tokenizer")
    return template, stop_ids(tokenizer, template, roles.eos_ids), tuple(dict.fromkeys([roles.eot_id, *roles.eos_ids]))


# --------------------------------------------------------------------------- CLI


def _encode_chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, str]], max_seq_len: int,
                        room: int, template: ChatTemplate | None = None) -> list[int]:
    """Ids of ``messages`` in ``template`` (None: ChatML) plus the generation
    prompt. While ``room`` more
    tokens would not fit in ``max_seq_len``, the oldest user/assistant exchange
    after the system message is dropped (a pair, so that roles still alternate)."""
    messages = list(messages)
    first = 1 if messages and messages[0]["role"] == "system" else 0
    while True:
        ids = encode_prompt(tokenizer, messages, template, add_generation_prompt=True)
        if len(ids) + room <= max_seq_len or len(messages) - first <= 1:
            return ids
        del messages[first:first + 2]


def _reply(model: Transformer, tokenizer: Tokenizer, ids: list[int], args: argparse.Namespace,
           stop_ids: tuple[int, ...]) -> str:
    new = generate(model, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_ids=stop_ids)
    if new and new[-1] in stop_ids:
        new = new[:-1]
    return tokenizer.decode(new, skip_special_tokens=False)


def _seed(text: str) -> int:
    """argparse type: a seed torch.Generator takes (beyond it torch said only
    "Overflow when unpacking long long")."""
    value = int(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2^64 - 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.model.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path("models/export"),
                   help="exported folder, checkpoint folder or step-XXXXXXXX folder (default: models/export)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help=f"tokenizer.json, or its folder, for checkpoint folders (default: {layout.TOKENIZER_JSON})")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompt", help="raw text to complete (\"\" samples a document from scratch)")
    mode.add_argument("--chat", action="append", help="a user message; repeat for a scripted conversation")
    mode.add_argument("--interactive", action="store_true", help="chat on stdin; /reset clears, /exit quits")
    p.add_argument("--system", help="system message for --chat and --interactive")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="0 = off")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help="1 = off")
    p.add_argument("--seed", type=_seed, default=0, help="0 to 2^64 - 1 (default: 0)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto (default: cpu)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.system is not None and args.prompt is not None:  # raw text has no system turn: it was dropped silently
        parser.error("--system goes with --chat or --interactive; --prompt completes raw text, "
                     "which has no system turn")
    if args.tokenizer is not None and args.tokenizer.is_dir():  # data/tokenizer, as the tokenizer stage names it
        args.tokenizer = args.tokenizer / "tokenizer.json"
    if args.chat and not all(text.strip() for text in args.chat):  # a chat template has no empty turn
        parser.error("--chat takes a message with some text; one was empty")
    try:
        model, tokenizer, config = load_for_inference(args.model, tokenizer_path=args.tokenizer, device=args.device)
        template, chat_stops, text_stops = prompting(args.model, tokenizer, args.tokenizer,
                                                     chat=args.prompt is None)
        if args.prompt is not None:
            # Every training document follows an end-of-text token, so an empty
            # prompt samples a document from scratch.
            ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids or [text_stops[0]]
            print(_reply(model, tokenizer, ids, args, text_stops))
            return 0
        history = [{"role": "system", "content": args.system}] if args.system else []
        turns = iter(args.chat) if args.chat else _stdin_turns()
        for text in turns:
            if text is None:  # /reset
                history = history[:1] if args.system else []
                continue
            history.append({"role": "user", "content": text})
            ids = _encode_chat_prompt(tokenizer, history, config.max_seq_len, room=args.max_new_tokens,
                                      template=template)
            if args.interactive and len(ids) > config.max_seq_len:  # the error ended the session, history and all
                print(f"error: that message takes {len(ids)} tokens; the model reads at most {config.max_seq_len}; "
                      "send a shorter one", file=sys.stderr, flush=True)
                history.pop()
                continue
            answer = _reply(model, tokenizer, ids, args, chat_stops)
            if answer.strip():
                history.append({"role": "assistant", "content": answer})
            else:  # a blank turn is not a valid message: forget the exchange instead
                history.pop()
            print(answer, flush=True)
        return 0
    except (FileNotFoundError, ValueError, StageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _stdin_turns() -> Iterator[str | None]:
    """User turns typed on stdin; None for /reset. Ends on EOF or /exit."""
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            yield None
        elif line.strip():
            yield line.rstrip("\n")


if __name__ == "__main__":
    raise SystemExit(main())
