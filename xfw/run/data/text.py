"""Conversations to token ids and labels, framework-free (Hugging Face ``tokenizers`` + jinja2).

A conversation (LLaVA's ``[{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", ...}]``)
becomes one text through a template, the text is split at each ``<image>`` and each piece
tokenized, and each image's tokens are put where its ``<image>`` was. Only answer tokens carry
loss: a token is trained when its characters overlap an answer span (the assistant's words and
the template's end-of-turn marker), every other label is IGNORE (-100)::

    tokenizer = Tokenizer.load(Path("tok"))          # tok/tokenizer.json [+ tokenizer_config.json]
    ids, labels = encode(tokenizer, turns, "vicuna_v1", lambda k: [IMAGE] * 576)

Templates (``data.template``):

* ``vicuna_v1``: LLaVA-1.5/1.6's conversation for SFT (``conv_vicuna_v1``)::

      <system> USER: <image>\\nQ ASSISTANT: A</s>USER: ... ASSISTANT: ...</s>

* ``plain``: LLaVA's pretraining (``conv_llava_plain``): the image, then the answer and a newline;
  the human's words are dropped.
* ``chatml``: Qwen2-VL's (``<|im_start|>role\\n...<|im_end|>\\n``, system "You are a helpful assistant.").
* ``tokenizer``: the ``chat_template`` of tokenizer_config.json, rendered with jinja2 in a sandbox;
  answer spans come from rendering each prefix of the conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from xfw.run.data import template as bounded

IGNORE_INDEX = -100
IMAGE = "<image>"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
VICUNA_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the human's questions.")
CHATML_SYSTEM = "You are a helpful assistant."


SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TemplateError(ValueError):
    """A conversation a template cannot render; the message says why."""


@dataclass
class Tokenizer:
    """A Hugging Face ``tokenizers`` tokenizer and what its tokenizer_config.json says."""

    impl: object
    config: dict
    directory: Path

    @classmethod
    def load(cls, directory: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HfTokenizer

        impl = HfTokenizer.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: not a JSON object")
        for name in SPECIAL_TOKENS:
            value = config.get(name)
            content = value.get("content") if isinstance(value, dict) else value
            if value is not None and not isinstance(content, str):
                raise ValueError(f"{config_path}: {name} must be a token's text (or {{\"content\": text}}), "
                                 f"got {repr(value)[:60]}")
        template = config.get("chat_template")
        if template is not None and not isinstance(template, (str, list)):
            raise ValueError(f"{config_path}: chat_template must be a string, got {type(template).__name__}")
        return cls(impl, config, directory)

    @property
    def vocab_size(self) -> int:
        return self.impl.get_vocab_size(with_added_tokens=True)

    def special(self, name: str) -> str | None:
        """A special token's text from tokenizer_config.json (``bos_token`` may be a string or an
        AddedToken dict)."""
        value = self.config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    def encode(self, text: str, *, first: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets; the tokenizer's own special tokens (a BOS) only for the first piece."""
        encoding = self.impl.encode(text, add_special_tokens=first)
        return list(encoding.ids), [tuple(o) for o in encoding.offsets]

    def token_id(self, text: str) -> int | None:
        return self.impl.token_to_id(text)


def roles(conversations: list) -> list[tuple[str, str]]:
    """``[(role, text)]`` from LLaVA's ``{"from", "value"}`` turns (human/gpt/system)."""
    out = []
    for i, turn in enumerate(conversations):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise TemplateError(f"turn {i} is not {{\"from\": ..., \"value\": \"...\"}}")
        speaker = turn.get("from")
        role = ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise TemplateError(f"turn {i} is from {repr(speaker)[:60]} (expected one of {', '.join(ROLES)})")
        out.append((role, turn["value"]))
    if not any(role == "assistant" for role, _ in out):
        raise TemplateError("has no answer (no turn from gpt)")
    return out


def _vicuna(turns, tokenizer: Tokenizer):
    eos = tokenizer.special("eos_token") or "</s>"
    system = next((text for role, text in turns if role == "system"), VICUNA_SYSTEM)
    text, spans = system + " ", []
    for role, value in turns:
        if role == "system":
            continue
        if role == "user":
            text += f"USER: {value} "
        else:
            text += "ASSISTANT: "
            spans.append((len(text), len(text) + len(value) + len(eos)))
            text += value + eos
    return text, spans


def _plain(turns, tokenizer: Tokenizer):
    text, spans = "", []
    for role, value in turns:
        if role == "user":
            text += IMAGE * value.count(IMAGE)  # LLaVA's pretraining keeps only the image of the prompt
        elif role == "assistant":
            spans.append((len(text), len(text) + len(value) + 1))
            text += value + "\n"
    return text, spans


def _chatml(turns, tokenizer: Tokenizer):
    system = next((text for role, text in turns if role == "system"), CHATML_SYSTEM)
    text, spans = f"<|im_start|>system\n{system}<|im_end|>\n", []
    for role, value in turns:
        if role == "system":
            continue
        text += f"<|im_start|>{role}\n"
        if role == "assistant":
            spans.append((len(text), len(text) + len(value) + len("<|im_end|>\n")))
        text += f"{value}<|im_end|>\n"
    return text, spans


def _jinja(turns, tokenizer: Tokenizer):
    """The tokenizer's chat template; each answer's span is what rendering the conversation up to
    and including it adds to rendering the conversation before it (with the generation prompt).
    Bounded (:mod:`xfw.run.data.template`): a template that fails, escapes the sandbox, loops or
    grows without end is a TemplateError."""
    template = bounded.compile_chat_template(tokenizer.config.get("chat_template"), fail=TemplateError)
    names = {k: tokenizer.special(k) or "" for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    messages = [{"role": role, "content": value} for role, value in turns]
    with bounded.time_limit(bounded.TIME_S, TemplateError):
        def render(upto: int, prompt: bool) -> str:
            return bounded.render(template, TemplateError, messages=messages[:upto], add_generation_prompt=prompt,
                                  **names)

        text, spans = render(len(messages), False), []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = render(i, True), render(i + 1, False)
            if not text.startswith(through) or not through.startswith(before):
                raise TemplateError("the chat template does not render a conversation's prefixes as prefixes")
            spans.append((len(before), len(through)))
    return text, spans


TEMPLATES = {"vicuna_v1": _vicuna, "plain": _plain, "chatml": _chatml, "tokenizer": _jinja}


def render(turns, template: str, tokenizer: Tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """(text, answer spans as character ranges)."""
    return TEMPLATES[template](turns, tokenizer)


def encode(tokenizer: Tokenizer, turns, template: str,
           image_ids: Callable[[int], list[int]]) -> tuple[list[int], list[int], int]:
    """(ids, labels, images) of one conversation: ``image_ids(k)`` gives the ids image ``k`` puts in
    place of its ``<image>``; labels copy the ids of answer tokens and IGNORE the rest."""
    text, spans = render(turns, template, tokenizer)
    ids, labels, start = [], [], 0
    pieces = text.split(IMAGE)
    marks = sum(value.count(IMAGE) for _, value in turns)  # one per image, in order
    if len(pieces) - 1 != marks:
        raise TemplateError(f"the template renders {len(pieces) - 1} '{IMAGE}' for the conversation's {marks} "
                            f"(a special token or the chat template writes '{IMAGE}' itself)")
    for k, piece in enumerate(pieces):
        piece_ids, offsets = tokenizer.encode(piece, first=k == 0)
        for token, (lo, hi) in zip(piece_ids, offsets):
            lo, hi = lo + start, hi + start
            trained = hi > lo and any(lo < end and hi > begin for begin, end in spans)
            ids.append(token)
            labels.append(token if trained else IGNORE_INDEX)
        start += len(piece) + len(IMAGE)
        if k < len(pieces) - 1:
            image = image_ids(k)
            ids += image
            labels += [IGNORE_INDEX] * len(image)
    return ids, labels, len(pieces) - 1


def choose_template(requested: str, family: str, stage: str, tokenizer: Tokenizer) -> str:
    """``auto``: the tokenizer's chat template when it has one, else LLaVA's (``plain`` for
    pretraining, ``vicuna_v1`` otherwise) or Qwen2-VL's ``chatml``."""
    if requested != "auto":
        return requested
    if isinstance(tokenizer.config.get("chat_template"), str):
        return "tokenizer"
    if family == "llava":
        return "plain" if stage == "pretrain" else "vicuna_v1"
    return "chatml"
