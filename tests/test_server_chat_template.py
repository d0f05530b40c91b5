"""Chat template controls and vLLM's utility endpoints, end to end (a real server, the official client and httpx):
`--chat-template` on a model without a template, `chat_template_kwargs`, `continue_final_message` and chat `echo`,
a request's own `chat_template` and its gate, /tokenize, /detokenize and /version, and each error naming its field.

tiny-huginn ships no chat template: everything chat here renders through the server's (or the request's)."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import ServerThread, offline_reference

import looped_spec
from looped_spec import LoopedSpecEngine, SamplingParams
from looped_spec.server.chat_template import ChatTemplateConfig

MODEL = "tiny-huginn"
API_KEY = "chat-key"
# prints a kwarg (`mood`) when given; an assistant turn ends with eos, which continue_final_message must leave out
TEMPLATE = (
    "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('a conversation cannot open with a tool') }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
    "{% endif %}\n{% endfor %}{% if mood is defined %}(mood: {{ mood }})\n{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
QUESTION = [{"role": "user", "content": "Reverse a string."}]
PREFILLED = QUESTION + [{"role": "assistant", "content": "def reverse(s):"}]


@pytest.fixture(scope="module")
def reference():
    yield from offline_reference(MODEL)


@pytest.fixture(scope="module")
def server():
    """tiny-huginn with the template above, request templates trusted, an API key set."""
    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    config = ChatTemplateConfig(chat_template=TEMPLATE, trust_request_chat_template=True)
    with ServerThread(engine, MODEL, api_key=API_KEY, chat_template=config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def rendered(reference, messages, **kw) -> str:
    """What transformers' own apply_chat_template renders with the server's template."""
    kw.setdefault("add_generation_prompt", True)
    return reference.tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, **kw)


def greedy(engine, prompt: str, max_tokens: int) -> str:
    return engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].text


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)  # no API key: these are open, as in vLLM


def error(response: httpx.Response, status: int = 400) -> tuple[str, str | None]:
    assert response.status_code == status, response.text
    info = response.json()["error"]
    return info["message"], info["param"]


def test_a_model_without_a_template_serves_chat_through_the_servers(server, client, reference):
    assert not reference.tokenizer.chat_template  # the premise: the model ships none
    prompt = rendered(reference, QUESTION)
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    assert out.choices[0].message.content == greedy(reference, prompt, 12)
    assert out.usage.prompt_tokens == len(reference.tokenizer.encode(prompt, add_special_tokens=False))


def test_chat_template_kwargs_reach_the_template_and_unread_ones_are_dropped(server, client, reference):
    body = {"model": MODEL, "messages": QUESTION, "chat_template_kwargs": {"mood": "calm", "enable_thinking": False}}
    tokens = post(server, "/tokenize", body).json()["tokens"]
    expected = rendered(reference, QUESTION, mood="calm")
    assert "(mood: calm)" in expected and reference.tokenizer.decode(tokens) == expected
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0,
                                         extra_body={"chat_template_kwargs": {"mood": "calm"}})  # fmt: skip
    assert out.usage.prompt_tokens == len(tokens)
    assert out.choices[0].message.content == greedy(reference, expected, 8)
    # a name the renderer takes itself is refused, pointing at the request's own field where there is one
    for name in ("add_generation_prompt", "chat_template", "tokenize", "messages"):
        message, param = error(post(server, "/tokenize", {**body, "chat_template_kwargs": {name: False}}))
        assert param == f"chat_template_kwargs.{name}" and message.startswith(param), message
    refused = {"chat_template_kwargs": {"add_generation_prompt": False}}
    with pytest.raises(openai.BadRequestError, match="set the request's add_generation_prompt field"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body=refused)


def test_continue_final_message_continues_the_last_message(server, client, reference):
    """The prompt is transformers' own continue_final_message rendering (no eos, no new turn); echo repeats the
    prefilled text before the continuation, streamed and not."""
    expected = rendered(reference, PREFILLED, add_generation_prompt=False, continue_final_message=True)
    assert expected.endswith("<assistant>def reverse(s):") and reference.tokenizer.eos_token not in expected
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    tokens = post(server, "/tokenize", {"model": MODEL, "messages": PREFILLED, **fields}).json()["tokens"]
    assert tokens == reference.tokenizer.encode(expected, add_special_tokens=False)
    continuation = greedy(reference, expected, 10)
    out = client.chat.completions.create(model=MODEL, messages=PREFILLED, max_tokens=10, temperature=0,
                                         extra_body=fields)  # fmt: skip
    assert out.choices[0].message.content == continuation and out.usage.prompt_tokens == len(tokens)
    echoed = client.chat.completions.create(model=MODEL, messages=PREFILLED, max_tokens=10, temperature=0,
                                            extra_body={**fields, "echo": True})  # fmt: skip
    assert echoed.choices[0].message.content == "def reverse(s):" + continuation
    assert echoed.usage.completion_tokens == out.usage.completion_tokens  # the echoed text is not generated
    chunks = list(client.chat.completions.create(model=MODEL, messages=PREFILLED, max_tokens=10, temperature=0,
                                                 stream=True, n=2, extra_body={**fields, "echo": True}))  # fmt: skip
    for index in (0, 1):
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == index]
        assert deltas[0].role == "assistant" and deltas[1].content == "def reverse(s):"
        assert "".join(d.content or "" for d in deltas) == "def reverse(s):" + continuation
    # echo repeats only an assistant's message: after a user's, the reply is the generated text alone
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                           extra_body={"echo": True})  # fmt: skip
    assert plain.choices[0].message.content == greedy(reference, rendered(reference, QUESTION), 6)


def test_continue_final_message_errors_name_it(server, client):
    # add_generation_prompt defaults to true: both at once is refused, as vLLM and transformers refuse it
    with pytest.raises(openai.BadRequestError, match="continue_final_message: cannot be true with "
                       "add_generation_prompt") as caught:  # fmt: skip
        client.chat.completions.create(model=MODEL, messages=PREFILLED, extra_body={"continue_final_message": True})
    assert caught.value.body["param"] == "continue_final_message"
    message, param = error(post(server, "/tokenize", {"messages": PREFILLED, "continue_final_message": True}))
    assert param == "continue_final_message"


def test_a_requests_own_chat_template_renders_its_prompt(server, client, reference):
    own = "{% for m in messages %}{{ m['content'] | upper }}|{% endfor %}"
    tokens = post(server, "/tokenize", {"messages": QUESTION, "chat_template": own}).json()["tokens"]
    assert reference.tokenizer.decode(tokens) == "REVERSE A STRING.|"
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                         extra_body={"chat_template": own})  # fmt: skip
    assert out.choices[0].message.content == greedy(reference, "REVERSE A STRING.|", 6)


def test_offline_and_served_chat_render_one_conversation_alike(server, client, reference):
    """engine.chat and the server hand a template the same messages (`name` on any role and an assistant's reasoning
    as both `reasoning` and `reasoning_content`, as vLLM passes them; a null content as ""; tool calls' arguments as
    a dict), so they render one prompt and reply alike."""
    own = (
        "{% for m in messages %}{{ m['role'] }}{% if m['name'] is defined %}({{ m['name'] }}){% endif %}: "
        "{{ m['content'] }}{% for c in m['tool_calls'] or [] %}[{{ c['function']['arguments']['s'] }}]{% endfor %}"
        "{% if m['reasoning'] %}<{{ m['reasoning'] }}|{{ m['reasoning_content'] }}>{% endif %}"
        "{{ '\\n' }}{% endfor %}assistant:"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "rev", "arguments": '{"s": "abc"}'}}
    messages = [{"role": "system", "content": "Be brief.", "name": "ops"}, {**QUESTION[0], "name": "ada"},
                {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "hm"},
                {"role": "tool", "content": "cba", "tool_call_id": "c1", "name": "rev"}]  # fmt: skip
    [offline] = reference.chat(messages, SamplingParams(max_tokens=6, temperature=0.0), chat_template=own)
    assert (
        offline.prompt
        == "system(ops): Be brief.\nuser(ada): Reverse a string.\nassistant: [abc]<hm|hm>\ntool(rev): cba\nassistant:"
    )
    tokens = post(server, "/tokenize", {"messages": messages, "chat_template": own}).json()["tokens"]
    assert tokens == offline.prompt_token_ids
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                         extra_body={"chat_template": own})  # fmt: skip
    assert out.choices[0].message.content == offline.text and out.usage.prompt_tokens == len(tokens)


@pytest.mark.parametrize(
    ("template", "messages", "field", "says"),
    [
        ("{% for m in messages %}{{ m.content }", QUESTION, "chat_template", "does not parse"),
        ("{{ raise_exception('no, thanks') }}", QUESTION, "chat_template", "no, thanks"),
        ("{{ messages[0].missing.deeper }}", QUESTION, "chat_template", "has no attribute 'missing'"),
        ("{{ messages | length // 0 }}", QUESTION, "chat_template", "ZeroDivisionError"),
        # the server's template refusing the messages (its raise_exception) blames the messages
        (None, [{"role": "tool", "content": "42", "tool_call_id": "c1"}], "messages", "cannot open with a tool"),
    ],
)
def test_template_failures_are_400s_naming_the_field(server, client, template, messages, field, says):
    extra = {"chat_template": template} if template is not None else {}
    with pytest.raises(openai.BadRequestError, match=says) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
    assert caught.value.body["param"] == field and caught.value.body["message"].startswith(field)
    message, param = error(post(server, "/tokenize", {"messages": messages, **extra}))
    assert param == field and says in message


def test_request_templates_need_the_trust_flag_and_a_model_without_one_says_how_to_serve_chat():
    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=64)
    with ServerThread(engine, MODEL) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--trust-request-chat-template") as caught:
            client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={"chat_template": "{{ 1 }}"})
        assert caught.value.body["param"] == "chat_template"
        message, param = error(post(running, "/tokenize", {"messages": QUESTION, "chat_template": "{{ 1 }}"}))
        assert param == "chat_template" and "--trust-request-chat-template" in message
        # no template anywhere: chat and chat /tokenize are 400s that name the flag which would serve them
        message, param = error(post(running, "/tokenize", {"messages": QUESTION}))
        assert param == "messages" and "--chat-template" in message
        with pytest.raises(openai.BadRequestError, match="--chat-template"):
            client.chat.completions.create(model=MODEL, messages=QUESTION)


def test_tokenize_a_prompt_equals_the_tokenizer(server, reference):
    tokenizer, prompt = reference.tokenizer, "def add(a, b):\n    return a + b"
    for special in (True, False):
        answer = post(server, "/tokenize", {"model": MODEL, "prompt": prompt, "add_special_tokens": special}).json()
        ids = tokenizer.encode(prompt, add_special_tokens=special)
        assert answer == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    strs = post(server, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()["token_strs"]
    assert strs == tokenizer.convert_ids_to_tokens(tokenizer.encode(prompt)) and len(strs) > 5
    chat = post(server, "/tokenize", {"messages": QUESTION, "return_token_strs": True}).json()
    assert chat["tokens"] == tokenizer.encode(rendered(reference, QUESTION), add_special_tokens=False)
    assert chat["token_strs"] == tokenizer.convert_ids_to_tokens(chat["tokens"])
    assert chat["count"] == len(chat["tokens"])


def test_a_null_field_of_tokenize_and_detokenize_is_an_unset_one(server, reference):
    """As on every other endpoint (and in /tokenize's chat form): a field sent as null takes its default (vLLM's
    `return_token_strs` is optional too); the prompt form and /detokenize had refused it as not a boolean."""
    prompt = "def add(a, b):"
    ids = reference.tokenizer.encode(prompt)
    nulls = {"model": None, "add_special_tokens": None, "return_token_strs": None, "messages": None}
    answer = post(server, "/tokenize", {"prompt": prompt, **nulls})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    chat = post(server, "/tokenize", {"messages": QUESTION, "return_token_strs": None})
    assert chat.status_code == 200 and chat.json()["token_strs"] is None
    answer = post(server, "/detokenize", {"tokens": ids, "model": None})
    assert answer.status_code == 200 and answer.json() == {"prompt": prompt}
    assert error(post(server, "/tokenize", {"prompt": None})) == ("prompt: Field required", "prompt")


def test_detokenize_round_trips_and_version(server, reference):
    prompt = "class Stack:\n    def push(self, x): ...  # ünïcode"
    tokens = post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    assert post(server, "/detokenize", {"model": MODEL, "tokens": tokens}).json() == {"prompt": prompt}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}
    assert httpx.get(server.url + "/version").json() == {"version": looped_spec.__version__}


def test_utility_endpoint_errors_name_their_field(server):
    vocab = server.engine.adapter.vocab_size
    message, param = error(post(server, "/detokenize", {"tokens": [1, vocab]}))
    assert param == "tokens" and message == f"tokens[1] = {vocab} is outside the vocabulary [0, {vocab})"
    assert error(post(server, "/detokenize", {"tokens": [-1]}))[1] == "tokens"
    assert error(post(server, "/detokenize", {"tokens": ["1"]}))[1] == "tokens[0]"
    assert error(post(server, "/tokenize", {"prompt": 5}))[1] == "prompt"
    # each form takes its own fields only: a chat field on a prompt is named
    message, param = error(post(server, "/tokenize", {"prompt": "x", "add_generation_prompt": False}))
    assert param == "add_generation_prompt" and "not a supported field" in message
    assert error(post(server, "/tokenize", {"messages": []}))[1] == "messages"
    raw = lambda body: httpx.post(server.url + "/tokenize", content=body, timeout=60)  # noqa: E731
    assert error(raw(b'{"prompt": "\\ud800"}'))[1] == "prompt"  # a lone surrogate, which JSON can carry
    assert error(raw(b'{"prompt": '))[0].startswith("request body is not valid JSON")
    assert error(raw(b"[" * 100_000))[0].startswith("request body is not valid JSON")  # nested past the parser
    assert error(post(server, "/tokenize", {"model": "gpt-4", "prompt": "x"}), 404)[1] == "model"
    assert error(post(server, "/detokenize", {"model": "gpt-4", "tokens": [1]}), 404)[1] == "model"


def test_the_utility_endpoints_are_open_and_v1_is_not(server):
    """As vLLM's: the API key guards /v1/* only (here /tokenize, /detokenize and /version answer without it)."""
    assert post(server, "/tokenize", {"prompt": "x"}).status_code == 200
    assert post(server, "/detokenize", {"tokens": [1]}).status_code == 200
    assert httpx.get(server.url + "/version").status_code == 200
    assert post(server, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION}).status_code == 401


def test_templates_render_off_the_event_loop_and_blame_what_they_render(server, client, reference, monkeypatch):
    """A template is code that may run long: it renders in a worker thread, never on the event loop that serves every
    other request (chat completions and /tokenize). Text parts are joined one a line (vLLM's string content format).
    A request's own template that renders nothing, or too much, is blamed by name."""
    import asyncio

    from looped_spec.server import app as app_module
    from looped_spec.server import tokenize as tokenize_module

    on_loop = []

    def recording(original):
        def call(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                on_loop.append(True)
            except RuntimeError:
                on_loop.append(False)
            return original(*args, **kwargs)

        return call

    monkeypatch.setattr(app_module, "chat_prompt", recording(app_module.chat_prompt))
    monkeypatch.setattr(tokenize_module, "chat_prompt", recording(tokenize_module.chat_prompt))
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]
    tokens = post(server, "/tokenize", {"messages": parts}).json()["tokens"]
    assert on_loop == [False, False]
    assert "<user>A\nB<" in reference.tokenizer.decode(tokens)
    for template in ("{{ '' }}", "{% for i in range(2000) %}ab {% endfor %}"):
        answer = httpx.post(
            server.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"model": MODEL, "messages": QUESTION, "chat_template": template},
            timeout=60,
        )
        message, param = error(answer)
        assert param == "chat_template" and message.startswith("chat_template"), message


def test_a_model_without_a_tokenizer_says_so_not_to_give_a_template_it_already_has():
    """A checkpoint without tokenizer files (a registered family's own, token ids in and out) given a chat template:
    chat is refused because no text can be encoded, which no template changes. The answer asked for the template it
    had been given (`--chat-template`, `chat_template=`)."""
    from conftest import fixture_dir

    engine = LoopedSpecEngine(str(fixture_dir("ouro")), speculation="off", max_model_len=64)  # no tokenizer files
    with pytest.raises(ValueError, match="the model has no tokenizer") as offline:
        engine.chat(QUESTION, SamplingParams(max_tokens=2), chat_template=TEMPLATE)
    assert "give one" not in str(offline.value)
    config = ChatTemplateConfig(chat_template=TEMPLATE, trust_request_chat_template=True)
    with ServerThread(engine, MODEL, chat_template=config) as running:
        for path, body in (("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": QUESTION, "chat_template": TEMPLATE}),
                           ("/tokenize", {"messages": QUESTION})):  # fmt: skip
            message, param = error(post(running, path, body))
            assert param == "messages" and "the model has no tokenizer" in message, (path, body, message)
            assert "--chat-template" not in message and "give one" not in message
