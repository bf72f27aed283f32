"""OpenAI request bodies -> validated generation requests, and the response objects.

Every field is checked here, before anything is queued: a bad value is a `BadRequest` (HTTP 400
with an OpenAI-style error naming the field), never an error later in the scheduler. Fields of
the OpenAI API that this server does not implement are refused when set to anything but their
neutral value; unknown fields are ignored.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
import uuid
from typing import Any

from ddtree_jax.serve.chat import ChatTemplate, TemplateError
from ddtree_jax.serve.scheduler import Request
from ddtree_jax.speculative.sampling import Sampling

MAX_STOP_STRINGS = 16
DEFAULT_COMPLETION_TOKENS = 16  # the OpenAI completions default; chat defaults to the rest of the context
ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


def error_body(message: str, err_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server can serve: checked against every request."""

    model: str
    max_context: int
    vocab_size: int
    max_top_k: int
    max_stop_ids: int


@dataclasses.dataclass(frozen=True)
class Job:
    """A parsed request: what to generate, and how to answer."""

    request: Request
    stream: bool
    include_usage: bool
    return_token_ids: bool
    chat: bool


# ---- field checks ---------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body, name, default, lo=None, hi=None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise BadRequest(f"{name} must be an integer, got {v!r}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"{name} must be in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}], "
                         f"got {v}", name)
    return v


def _num(body, name, default, lo, hi, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v) or v != v:
        raise BadRequest(f"{name} must be a number, got {v!r}", name)
    if v > hi or v < lo or (lo_open and v == lo):
        raise BadRequest(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _bool(body, name, default=False):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be a boolean, got {v!r}", name)
    return v


def _neutral(value, allowed) -> bool:
    return any(type(value) is type(a) and value == a for a in allowed)


def _unsupported(body: dict, chat: bool) -> None:
    """Refuse OpenAI features this server does not implement, unless set to their neutral value."""
    neutral = {"n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "presence_penalty": (0, 0.0),
               "frequency_penalty": (0, 0.0), "logit_bias": ({},), "tools": ([],), "functions": ([],),
               "response_format": ({"type": "text"},), "logprobs": (False,) if chat else (0,), "top_logprobs": (0,)}
    for name, allowed in neutral.items():
        value = body.get(name)
        if value is not None and not _neutral(value, allowed):
            what = "this server returns one choice (n = 1)" if name in ("n", "best_of") else "not supported"
            raise BadRequest(f"{name}={value!r}: {what}", name, "unsupported_parameter")


def _model(body: dict, limits: Limits) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {model!r}", "model")
    if model != limits.model:
        raise BadRequest(f"the model {model!r} does not exist: this server serves {limits.model!r}", "model",
                         "model_not_found")


def _stop(body: dict, limits: Limits) -> tuple[tuple[str, ...], tuple[int, ...]]:
    stop = body.get("stop")
    if stop is None:
        strings = []
    elif isinstance(stop, str):
        strings = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        strings = stop
    else:
        raise BadRequest(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    if len(strings) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop has {len(strings)} strings, at most {MAX_STOP_STRINGS}", "stop")
    if any(not s for s in strings):
        raise BadRequest("stop strings must not be empty", "stop")
    ids = body.get("stop_token_ids")
    if ids is None:
        ids = []
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise BadRequest(f"stop_token_ids must be a list of integers, got {ids!r}", "stop_token_ids")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise BadRequest(f"stop_token_ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}", "stop_token_ids")
    ids = sorted(set(ids))
    if len(ids) > limits.max_stop_ids:
        raise BadRequest(f"stop_token_ids has {len(ids)} ids, this server takes at most {limits.max_stop_ids}",
                         "stop_token_ids")
    return tuple(strings), tuple(ids)


def _sampling(body: dict, limits: Limits) -> tuple[Sampling, int]:
    temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, -1)
    if top_k == -1:
        top_k = 0
    if top_k > limits.max_top_k:
        raise BadRequest(f"top_k must be at most {limits.max_top_k} on this server (--max-top-k), got {top_k}", "top_k")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbits(63)
    elif not _is_int(seed) or not -(2**63) <= seed < 2**64:
        raise BadRequest(f"seed must be a 64-bit integer, got {seed!r}", "seed")
    return Sampling(temperature, top_k, top_p), seed


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise BadRequest(f"stream_options must be an object, got {opts!r}", "stream_options")
    if not stream:
        raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
    return stream, _bool(opts, "include_usage")


def _budget(body: dict, names: tuple[str, ...], n_prompt: int, limits: Limits, default: int | None) -> int:
    """max_tokens (or its chat alias), checked against the context."""
    given = [(n, body[n]) for n in names if body.get(n) is not None]
    name = given[0][0] if given else names[0]
    max_new = _int(body, name, None, 1)
    if n_prompt >= limits.max_context:
        raise BadRequest(f"this model's maximum context length is {limits.max_context} tokens; the prompt has "
                         f"{n_prompt}", "messages" if "max_completion_tokens" in names else "prompt",
                         "context_length_exceeded")
    if max_new is None:
        max_new = limits.max_context - n_prompt if default is None else min(default, limits.max_context - n_prompt)
    if n_prompt + max_new > limits.max_context:
        raise BadRequest(f"this model's maximum context length is {limits.max_context} tokens; you requested "
                         f"{n_prompt + max_new} ({n_prompt} in the prompt, {max_new} for the completion)", name,
                         "context_length_exceeded")
    return max_new


def _prompt_ids(body: dict, tokenizer, limits: Limits) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt).ids
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise BadRequest(f"prompt has token ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}",
                             "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(f"prompt holds {len(prompt)} prompts: this server takes one per request", "prompt")
    elif prompt is None:
        raise BadRequest("prompt is required", "prompt")
    else:
        raise BadRequest("prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise BadRequest("prompt is empty (no tokens)", "prompt")
    return ids


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {ROLES}, got {role!r}", "messages")
        if isinstance(content, list):  # content parts: text only
            parts = []
            for p in content:
                if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
                parts.append(p["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({**{k: v for k, v in m.items() if k not in ("role", "content")}, "role": role, "content": content})
    return out


# ---- the two endpoints ------------------------------------------------------------------------
def parse_completion(body: Any, limits: Limits, tokenizer) -> Job:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _model(body, limits)
    _unsupported(body, chat=False)
    ids = _prompt_ids(body, tokenizer, limits)
    max_new = _budget(body, ("max_tokens",), len(ids), limits, DEFAULT_COMPLETION_TOKENS)
    return _job(body, limits, tokenizer, ids, max_new, chat=False)


def parse_chat(body: Any, limits: Limits, tokenizer, template: ChatTemplate | None) -> Job:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _model(body, limits)
    _unsupported(body, chat=True)
    messages = _messages(body)
    if template is None:
        raise BadRequest(f"the model {limits.model!r} has no chat template (chat_template.jinja or tokenizer_config."
                         "json's chat_template): use /v1/completions", "messages", "no_chat_template")
    try:
        text = template.render(messages, add_generation_prompt=True)
    except TemplateError as e:
        raise BadRequest(str(e), "messages") from e
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        raise BadRequest("the rendered conversation has no tokens", "messages")
    max_new = _budget(body, ("max_completion_tokens", "max_tokens"), len(ids), limits, None)
    return _job(body, limits, tokenizer, ids, max_new, chat=True)


def _job(body, limits, tokenizer, ids, max_new, chat) -> Job:
    sampling, seed = _sampling(body, limits)
    stop, stop_ids = _stop(body, limits)
    stream, include_usage = _stream(body)
    return_ids = _bool(body, "return_token_ids")
    request = Request(tuple(ids), max_new, sampling, seed, stop_ids, stop)
    return Job(request, stream, include_usage, return_ids, chat)


# ---- responses ------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(job: Job, rid: str, model: str, text: str, token_ids: list[int], finish: str, prompt_tokens: int,
             completion_tokens: int) -> dict:
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if job.return_token_ids:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion" if job.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def chunk(job: Job, rid: str, model: str, text: str | None, token_ids: list[int] | None, finish: str | None,
          role: bool = False) -> dict:
    """One streamed chunk: text (None: no content field), finish reason on the last."""
    if job.chat:
        delta = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    if job.return_token_ids and token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(job: Job, rid: str, model: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
