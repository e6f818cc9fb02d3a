"""The real targets' published chat templates (verbatim, in
tests/chat_templates/, where each was read: SOURCES.md there) on a
tokenizer that carries each target's own special tokens: the tiny model's
byte-level BPE with the target's added tokens (special as its
tokenizer_config.json marks them), its end of sequence, and the tokens its
generation_config.json stops on. Token ids differ from the real
tokenizer's; what a render is made of, which pieces are single tokens and
where the target stops are the target's."""
from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path

TEMPLATES = Path(__file__).with_name("chat_templates")


@dataclass(frozen=True)
class Published:
    name: str
    template: str  # file under tests/chat_templates/
    specials: tuple  # tokens its tokenizer_config.json marks special
    added: tuple = ()  # added tokens it marks not special (Qwen3's <think>, <tool_call>)
    bos: str | None = None
    eos: str = ""
    stops: tuple = ()  # generation_config.json eos_token_id, as texts
    switch: str | None = None  # the kwarg that turns reasoning on or off
    thinking_default: bool | None = None  # reasoning on when served without the switch


QWEN3 = Published(
    "qwen3", "qwen3.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
    eos="<|im_end|>", stops=("<|im_end|>", "<|endoftext|>"), switch="enable_thinking", thinking_default=True)
KIMI_K25 = Published(
    "kimi-k2.5", "kimi-k2.5.jinja",
    ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
     "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
     "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|media_begin|>", "<|media_content|>", "<|media_pad|>",
     "<|media_end|>"),
    bos="[BOS]", eos="[EOS]", stops=("<|im_end|>",), switch="thinking", thinking_default=True)
GLM45 = Published(
    "glm-4.5", "glm-4.5.jinja",
    ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
     "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>",
     "<arg_value>", "</arg_value>"),
    eos="<|endoftext|>", stops=("<|endoftext|>", "<|user|>", "<|observation|>"), switch="enable_thinking",
    thinking_default=True)
GPT_OSS = Published(
    "gpt-oss-120b", "gpt-oss-120b.jinja",
    ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
     "<|return|>", "<|call|>"),
    eos="<|return|>", stops=("<|return|>", "<|endoftext|>", "<|call|>"), thinking_default=True)
DEEPSEEK_V31 = Published(
    "deepseek-v3.1", "deepseek-v3.1.jinja",
    ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
     "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
     "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
    bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", stops=("<｜end▁of▁sentence｜>",), switch="thinking",
    thinking_default=False)
LLAMA31 = Published(
    "llama-3.1", "llama-3.1.jinja",
    ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
     "<|eom_id|>", "<|python_tag|>"),
    bos="<|begin_of_text|>", eos="<|eot_id|>", stops=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"))

ALL = (QWEN3, KIMI_K25, GLM45, GPT_OSS, DEEPSEEK_V31, LLAMA31)


def template(target: Published) -> str:
    """`target`'s published chat template, verbatim."""
    return (TEMPLATES / target.template).read_text()
REASONING = (QWEN3, KIMI_K25, GLM45, GPT_OSS, DEEPSEEK_V31)


@functools.lru_cache(maxsize=None)
def _base():
    from transformers import AutoTokenizer

    from tests.tiny_models import TINY, ensure_model

    return AutoTokenizer.from_pretrained(ensure_model(TINY))


def tokenizer_for(target: Published):
    """The tiny tokenizer carrying `target`'s template and tokens."""
    from tokenizers import AddedToken

    tok = copy.deepcopy(_base())
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in target.specials], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in target.added])
    tok.eos_token = target.eos
    tok.bos_token = target.bos
    tok.chat_template = (TEMPLATES / target.template).read_text()
    return tok


def model_dir_for(target: Published, out: Path) -> Path:
    """A folder with `target`'s tokenizer and its generation_config.json
    (what tasks/data/chat.py stop_texts reads), no weights."""
    tok = tokenizer_for(target)
    tok.save_pretrained(out)
    ids = [tok.convert_tokens_to_ids(t) for t in target.stops]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}) + "\n")
    return out
