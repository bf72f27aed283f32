"""The serving layer's text and request handling, without a model: stop strings across tokens,
chat templates rendered as HF does, every bad field of an OpenAI request refused with a 400
naming it, good requests parsed, and ddtree-serve's own refusals before it starts."""

import pytest

pytest.importorskip("fastapi")

from ddtree_jax.serve import protocol  # noqa: E402
from ddtree_jax.serve.chat import ChatTemplate  # noqa: E402
from ddtree_jax.serve.text import TextStream  # noqa: E402
from ddtree_jax.speculative.sampling import Sampling  # noqa: E402
from tests.cli_fixtures import char_tokenizer  # noqa: E402

VOCAB = 128  # the limits' vocabulary (ids at or above it are refused)
TOKENIZER = char_tokenizer()


def test_text_stream_stop_strings_across_tokens():
    tok = TOKENIZER
    ids = tok.encode("hello world, stop here").ids
    s = TextStream(tok, stop=("lo w", "zzz"))
    streamed = ""
    for i, t in enumerate(ids):  # noqa: B007 (i is read after the loop: the token the stream stopped at)
        hit = s.add(t)
        streamed += s.ready(final=hit)
        if hit:
            break
    assert streamed == "hel" and s.stopped and i == ids.index(tok.encode("w").ids[0])
    s = TextStream(tok, stop=("xyz",))
    for t in tok.encode("abcx").ids:
        s.add(t)
    assert s.ready() == "abc"  # "x" may begin the stop string: held back
    assert s.ready(final=True) == "x"


def test_chat_template_renders_like_hf():
    t = ChatTemplate("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no') }}"
                     "{% endif %}<|{{ m.role }}|>\n{{ m.content | trim }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>\n{% endif %}", {"bos_token": "<s>"})
    assert t.render([{"role": "user", "content": " hi "}]) == "<s><|user|>\nhi\n<|assistant|>\n"
    with pytest.raises(ValueError, match="no"):
        t.render([{"role": "system", "content": "x"}])


LIMITS = protocol.Limits("m", max_context=64, vocab_size=VOCAB, max_top_k=8, max_stop_ids=2)


@pytest.mark.parametrize("body, param", [
    ({"model": "other", "prompt": "a"}, "model"),
    ({"prompt": "a" * 70}, "prompt"),
    ({"prompt": "a" * 50, "max_tokens": 20}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "a", "temperature": -0.1}, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_k": 9}, "top_k"),
    ({"prompt": "a", "top_k": -2}, "top_k"),
    ({"prompt": "a", "seed": "x"}, "seed"),
    ({"prompt": "a", "stop": 3}, "stop"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"prompt": "a", "stop_token_ids": [2, 3, 4]}, "stop_token_ids"),
    ({"prompt": "a", "n": 2}, "n"),
    ({"prompt": "a", "logprobs": 3}, "logprobs"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [1, VOCAB]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({}, "prompt"),
    ([1, 2], None),
])
def test_every_bad_completion_field_is_a_400(body, param):
    with pytest.raises(protocol.BadRequest) as e:
        protocol.parse_completion(body, LIMITS, TOKENIZER)
    assert e.value.status == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize("body, template", [
    ({"messages": []}, True),
    ({"messages": [{"role": "wizard", "content": "x"}]}, True),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True),
    ({"messages": [{"role": "user", "content": "x"}]}, False),
    ({"messages": [{"role": "user", "content": "x" * 70}]}, True),
])
def test_bad_chat_requests_are_400(body, template):
    tpl = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}") if template else None
    with pytest.raises(protocol.BadRequest) as e:
        protocol.parse_chat(body, LIMITS, TOKENIZER, tpl)
    assert e.value.status == 400 and e.value.param == "messages"
    if not template:
        assert "no chat template" in e.value.message


def test_good_requests_parse():
    job = protocol.parse_completion({"model": "m", "prompt": [5, 6], "max_tokens": 3, "temperature": 0, "top_k": -1,
                                     "stop": "x", "stop_token_ids": [2], "seed": 7, "stream": True,
                                     "stream_options": {"include_usage": True}, "n": 1, "user": "u"}, LIMITS, TOKENIZER)
    r = job.request
    assert r.prompt_ids == (5, 6) and r.max_new == 3 and r.sampling == Sampling() and r.seed == 7
    assert r.stop == ("x",) and r.stop_ids == (2,) and job.stream and job.include_usage
    tpl = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    job = protocol.parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}]}, LIMITS,
                              TOKENIZER, tpl)
    assert job.request.max_new == 64 - 2 and job.request.sampling.temperature == 1.0 and job.chat


def test_serve_without_its_extra_names_the_extra(monkeypatch, capsys):
    import importlib
    import signal

    from ddtree_jax.cli import serve as cli

    real = importlib.import_module

    def no_uvicorn(name, *args):
        if name == "uvicorn":
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_uvicorn)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    with pytest.raises(SystemExit) as e:
        cli.main([])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "uvicorn" in err and "pip install 'ddtree-jax[serve]'" in err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "--max-batch" in capsys.readouterr().out


def test_serve_refuses_a_prefill_larger_than_the_batch(monkeypatch, capsys):
    import signal

    from ddtree_jax.cli import serve as cli

    monkeypatch.setattr(signal, "signal", lambda *a: None)
    with pytest.raises(SystemExit) as e:
        cli.main(["--max-batch", "4", "--max-prefill", "8"])
    out = capsys.readouterr()
    assert e.value.code == 2 and "--max-prefill (8) cannot exceed --max-batch (4)" in out.err and out.out == ""
