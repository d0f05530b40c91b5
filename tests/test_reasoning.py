"""Reasoning parsers (vLLM's `--reasoning-parser`): a chat reply's `<think>` reasoning apart from its content, whole
and streamed, with the deltas adding up to the whole reply whatever the chunking; beside tool calling; beside a grammar
(which starts after the reasoning); an assistant's reasoning sent back reaches the template."""

from __future__ import annotations

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import ServerThread

from looped_spec import LoopedSpecEngine
from looped_spec.cli import main
from looped_spec.reasoning import REASONING_PARSERS, ReasoningStream, Split, reasoning_parser
from looped_spec.request import RequestMetrics, RequestOutput
from looped_spec.server.chat_template import ChatTemplateConfig
from looped_spec.server.serving import OpenAIServing
from looped_spec.server.tools import ToolCallingConfig

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
MODEL = "tiny-ouro"
HELLO = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("text", "r1", "qwen3"),
    [
        ("<think>plan</think>answer", ("plan", "answer"), ("plan", "answer")),
        ("\n <think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer"), ("\nplan\n", "\n\nanswer")),
        ("plan</think>answer", ("plan", "answer"), (None, "plan</think>answer")),  # r1: opened by the template
        ("just an answer", ("just an answer", None), (None, "just an answer")),  # r1: never closed, all reasoning
        ("<think>cut short", ("cut short", None), ("cut short", None)),
        ("<think></think>answer", ("", "answer"), ("", "answer")),
        ("<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),  # the first close ends it
        ("", ("", None), (None, "")),
        ("\n\nplan</think>x", ("\n\nplan", "x"), (None, "\n\nplan</think>x")),  # as written, leading newlines too
        ("\n\n", ("\n\n", None), (None, "\n\n")),  # a reply of whitespace keeps it
    ],
)
def test_a_whole_reply_splits_by_each_parsers_rule(text, r1, qwen3):
    assert R1.split(text) == Split(*r1)
    assert QWEN3.split(text) == Split(*qwen3)


PIECES = ["<think>", "</think>", "<th", "ink>", "</", "think", ">", "<", "a", "b c", "\n", " ", "x</thi", "nk>y"]


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(
    st.sampled_from(["deepseek_r1", "qwen3"]),
    st.sampled_from(["", "<think>", " \n<think>", "\n", "<thinking>"]),  # how replies begin decides the split
    st.lists(st.sampled_from(PIECES), max_size=10),
    st.data(),
)
def test_streamed_pieces_add_up_to_the_whole_reply_whatever_the_chunking(name, start, pieces, data):
    parser = REASONING_PARSERS[name]
    text = start + "".join(pieces)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)))))  # anywhere, often every few characters
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = ReasoningStream(parser)
    reasoning, content = "", ""
    for i, chunk in enumerate(chunks):
        thought, said = stream.feed(chunk, finished=i == len(chunks) - 1)
        reasoning, content = reasoning + thought, content + said
        # what was sent is never taken back: a prefix of the whole reply's fields
        whole = parser.split(text)
        assert (whole.reasoning or "").startswith(reasoning) and (whole.content or "").startswith(content)
    whole = parser.split(text)
    assert (reasoning, content) == (whole.reasoning or "", whole.content or "")


def test_an_unknown_parser_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"--reasoning-parser 'r2': unknown; known: deepseek_r1, qwen3"):
        reasoning_parser("r2")


def scripted(monkeypatch, replies: list[list[str]]) -> None:
    """The server's engine streams are replaced by these replies (one per choice, in pieces): the tiny model never
    thinks aloud, and a grammar cannot force it to under a reasoning parser."""

    def start_all(self, prompts, params, priority=0, cache_salt=None):
        async def stream(index: int, pieces: list[str]):
            tokens: list[int] = []
            for j, piece in enumerate(pieces):
                tokens.append(1)
                last = j == len(pieces) - 1
                yield RequestOutput(str(index), prompts[index], list(tokens), "".join(pieces[: j + 1]),
                                    "stop" if last else None, last, RequestMetrics(), new_token_ids=[1],
                                    new_text=piece)  # fmt: skip

        return [stream(i, replies[i % len(replies)]) for i in range(len(prompts))]

    monkeypatch.setattr(OpenAIServing, "start_all", start_all)


@pytest.fixture(scope="module")
def server():
    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    tools = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with ServerThread(engine, MODEL, tool_calling=tools, reasoning_parser="deepseek_r1") as running:
        yield running


def streamed(client, **request) -> tuple[str | None, str | None, list]:
    reasoning = content = None
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, stream=True, **request):
        for choice in chunk.choices:
            delta = choice.delta
            piece = (delta.model_extra or {}).get("reasoning")
            if piece is not None:
                reasoning = (reasoning or "") + piece
            if delta.content is not None:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return reasoning, content, [calls[k] for k in sorted(calls)]


@pytest.mark.parametrize(
    ("pieces", "reasoning", "content"),
    [
        (["<th", "ink>I should", " greet.</th", "ink>\n\nHel", "lo!"], "I should greet.", "\n\nHello!"),
        (["Greeting", " them.", "</think>", "Hi"], "Greeting them.", "Hi"),  # opened by the template
        (["Still", " thinking"], "Still thinking", None),  # cut before it closed: all reasoning
    ],
)
def test_chat_replies_carry_the_reasoning_apart_whole_and_streamed(server, monkeypatch, pieces, reasoning, content):
    scripted(monkeypatch, [pieces])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    message = client.chat.completions.create(model=MODEL, messages=HELLO).choices[0].message
    assert (message.model_extra["reasoning"], message.content) == (reasoning, content)
    assert streamed(client) == (reasoning, content, [])
    hidden = client.chat.completions.create(model=MODEL, messages=HELLO, extra_body={"include_reasoning": False})
    assert "reasoning" not in hidden.choices[0].message.model_extra and hidden.choices[0].message.content == content
    assert streamed(client, extra_body={"include_reasoning": False}) == (None, content, [])


def test_tool_calls_are_parsed_from_the_content_after_the_reasoning(server, monkeypatch):
    call = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    scripted(monkeypatch, [["<think>The time? A tool.", "</think>", "Let me check. ", call[:12], call[12:]]])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    tools = [{"type": "function", "function": {"name": "now"}}]
    choice = client.chat.completions.create(model=MODEL, messages=HELLO, tools=tools).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning"] == "The time? A tool."
    assert choice.message.content == "Let me check. " and choice.message.tool_calls[0].function.name == "now"
    assert streamed(client, tools=tools) == ("The time? A tool.", "Let me check. ", [{"name": "now",
                                                                                      "arguments": "{}"}])  # fmt: skip


def test_a_grammar_beside_a_reasoning_parser_shapes_the_content_after_it(server, monkeypatch):
    """A grammar (structured outputs, response_format, a forced tool call) is served beside a reasoning parser: it
    starts after `</think>` (tests/test_grammar_after_reasoning.py), so the reply's content is what it shaped, and a
    forced call is parsed from the content, whole and streamed (the replies scripted: the tiny model never thinks)."""
    now = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    cases = [
        ({"structured_outputs": {"choice": ["a", "b"]}}, "b", None),
        ({"response_format": {"type": "json_object"}}, '{"x": 1}', None),
        ({"tools": now, "tool_choice": "required"}, '[{"name": "now", "parameters": {}}]', [{"name": "now",
                                                                                           "arguments": "{}"}]),
        ({"tools": now, "tool_choice": {"type": "function", "function": {"name": "now"}}}, '{"tz": "UTC"}',
         [{"name": "now", "arguments": '{"tz": "UTC"}'}]),
    ]  # fmt: skip
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    for extra, content, calls in cases:
        scripted(monkeypatch, [["<think>Think", " first.</th", "ink>", content[:3], content[3:]]])
        answer = httpx.post(server.url + "/v1/chat/completions",
                            json={"model": MODEL, "messages": HELLO, **extra}, timeout=60)  # fmt: skip
        assert answer.status_code == 200, answer.text
        message = answer.json()["choices"][0]["message"]
        assert message["reasoning"] == "Think first.", extra
        if calls is None:
            assert message["content"] == content and not message.get("tool_calls"), extra
        else:
            assert message["content"] is None, extra
            assert [{k: c["function"][k] for k in ("name", "arguments")} for c in message["tool_calls"]] == calls
        request = dict(extra)
        tool_choice = request.pop("tool_choice", None)
        tools = request.pop("tools", None)
        streamed_reply = streamed(client, **({"tools": tools, "tool_choice": tool_choice} if tools else {}),
                                  extra_body=request)  # fmt: skip
        assert streamed_reply == ("Think first.", content if calls is None else None, calls or []), extra


def test_an_assistants_reasoning_sent_back_reaches_the_template():
    template = "{% for m in messages %}[{{ m.role }}|{{ m.reasoning_content or '-' }}|{{ m.content }}]{% endfor %}"
    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    with ServerThread(engine, MODEL, chat_template=ChatTemplateConfig(chat_template=template)) as server:
        for field in ("reasoning", "reasoning_content"):
            messages = [*HELLO, {"role": "assistant", "content": "Hello", field: "be kind"}]
            body = {"model": MODEL, "messages": messages, "add_generation_prompt": False}
            tokens = httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]
            text = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": tokens}, timeout=60)
            assert text.json()["prompt"] == "[user|-|hi][assistant|be kind|Hello]"
        bad = [{"role": "user", "content": "hi", "reasoning": "no"}]
        answer = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": bad}, timeout=60)
        assert answer.status_code == 400 and "reasoning: only on assistant messages" in answer.text
    # a server without a reasoning parser answers as before: no reasoning field at all
    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    with ServerThread(engine, MODEL) as server:
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 3}
        assert "reasoning" not in httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).text


def test_serve_takes_a_reasoning_parser_flag(monkeypatch, capsys):
    served = {}
    monkeypatch.setattr("looped_spec.server.launch.serve", lambda engine, name, **kw: served.update(kw))
    assert main(["serve", MODEL, "--reasoning-parser", "qwen3", "--log-level", "warning"]) == 0
    assert served["reasoning_parser"] == "qwen3"
    assert main(["serve", MODEL, "--reasoning-parser", "r2"]) == 2
    assert "--reasoning-parser 'r2': unknown; known: deepseek_r1, qwen3" in capsys.readouterr().err


def test_replicas_take_a_reasoning_parser_named_in_their_args():
    from looped_spec.server.replicas import parse_args

    assert parse_args({"reasoning_parser": "deepseek_r1"}).reasoning_parser == "deepseek_r1"
    with pytest.raises(ValueError, match=r"reasoning_parser: --reasoning-parser 'r2': unknown; known: deepseek_r1"):
        parse_args({"reasoning_parser": "r2"})
