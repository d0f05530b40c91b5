"""`looped-spec serve --chat-template / --trust-request-chat-template`: the template (a file, or written inline by
vLLM's rule) reaches the server and Ray Serve replicas; a missing file or a template that does not parse is a usage
error naming the flag, before the engine loads."""

from __future__ import annotations

import httpx
import pytest
from server_utils import ServerThread

import looped_spec
from looped_spec.cli import main
from looped_spec.server.chat_template import ChatTemplateConfig

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture
def served(monkeypatch) -> dict:
    """What `serve` hands the server (`serve` replaced by a recorder: nothing is started), the engine included."""
    recorded = {}
    monkeypatch.setattr("looped_spec.server.launch.serve",
                        lambda engine, name, **kw: recorded.update(kw, engine=engine, name=name))  # fmt: skip
    return recorded


def test_a_template_file_reaches_the_server_which_renders_chat_with_it(served, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert main(["serve", "tiny-huginn", "--chat-template", str(path), "--log-level", "warning"]) == 0
    assert served["chat_template"] == ChatTemplateConfig(chat_template=TEMPLATE)
    # the server the flags built: tiny-huginn (no template of its own) renders chat with the file's
    with ServerThread(served["engine"], "tiny-huginn", chat_template=served["chat_template"]) as server:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        tokens = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
        assert served["engine"].tokenizer.decode(tokens) == "[user] hi\n"
    served["engine"].close()


def test_an_inline_template_and_the_trust_flag(served):
    trusted = ["--chat-template", TEMPLATE, "--trust-request-chat-template"]
    assert main(["serve", "tiny-huginn", *trusted, "--log-level", "warning"]) == 0
    assert served["chat_template"] == ChatTemplateConfig(chat_template=TEMPLATE, trust_request_chat_template=True)
    assert main(["serve", "tiny-ouro", "--log-level", "warning"]) == 0
    assert served["chat_template"] == ChatTemplateConfig()  # the tokenizer's own, request templates refused


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("templates/missing.jinja", "--chat-template: 'templates/missing.jinja' looks like a file path, but it does "
         "not open (No such file or directory)"),
        ("{% for m in messages %}{{ m.content }}", "--chat-template '{% for m in messages %}{{ m.content }}': does not "
         "parse: Unexpected end of template"),
    ],
)  # fmt: skip
def test_a_template_that_cannot_serve_is_a_usage_error_before_the_engine_loads(value, message, capsys, monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the flag was checked")

    monkeypatch.setattr(looped_spec, "LoopedSpecEngine", no_engine)
    for replicas in ([], ["--replicas", "1"]):
        assert main(["serve", "tiny-ouro", "--chat-template", value, *replicas]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_the_template_reaches_ray_serve_replicas(monkeypatch, tmp_path):
    """`serve --replicas` sends the template's text (not the path: a replica may run on another node) in the
    application's arguments, which the replica's app is built with."""
    from looped_spec.server.replicas import build_application

    started = {}
    monkeypatch.setattr("looped_spec.server.replicas.run_replicas", lambda args, host, port: started.update(args=args))
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    argv = ["serve", "tiny-ouro", "--replicas", "2", "--chat-template", str(path), "--trust-request-chat-template"]
    assert main(argv) == 0
    expected = ChatTemplateConfig(chat_template=TEMPLATE, trust_request_chat_template=True)
    assert started["args"].chat_template == expected
    bound = build_application(started["args"])._bound_deployment
    assert bound.init_args[0]["chat_template"] == expected.model_dump()
