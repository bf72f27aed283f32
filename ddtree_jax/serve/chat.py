"""Chat templates as Hugging Face renders them: the model's Jinja template (chat_template.jinja,
or tokenizer_config.json's "chat_template") in a sandboxed Jinja environment with trim_blocks and
lstrip_blocks, the loop controls extension, `raise_exception` and `strftime_now`, a `tojson` that
keeps non-ASCII characters, and the tokenizer's special tokens (bos_token, eos_token, ...) as
variables."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateError(ValueError):
    """The template refused the conversation (its raise_exception, or a rendering error)."""


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value) -> str | None:
    """A special token entry of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed on these messages: {e}") from e


def load_chat_template(model_dir: str | os.PathLike) -> ChatTemplate | None:
    """The directory's chat template, or None when it has none. chat_template.jinja wins over
    tokenizer_config.json's "chat_template" (a string, or a list of {name, template}: "default")."""
    model_dir = os.fspath(model_dir)
    config: dict = {}
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    source = None
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            source = f.read()
    else:
        entry = config.get("chat_template")
        if isinstance(entry, list):
            named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
            entry = named.get("default")
        source = entry if isinstance(entry, str) else None
    if not source:
        return None
    specials = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
    try:
        return ChatTemplate(source, specials)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template of {model_dir} does not parse: {e}") from e
