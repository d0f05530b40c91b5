"""LoopedSpecEngine.chat (vLLM's LLM.chat): conversations rendered by a chat template, then generated. The reference
is transformers' own `apply_chat_template` followed by `generate` on its token ids."""

from __future__ import annotations

import copy

import pytest

from looped_spec import LoopedSpecEngine, SamplingParams
from looped_spec.engine.chat import NoChatTemplateError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ASK = [{"role": "user", "content": "Reverse a string."}]
CONTINUE = [{"role": "user", "content": "Add two numbers."}, {"role": "assistant", "content": "def add("}]


@pytest.fixture(scope="module")
def engine():
    with LoopedSpecEngine("tiny-ouro", speculation="adaptive", max_batch_size=4, max_model_len=256) as running:
        yield running


def template_ids(tokenizer, messages, **options) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_generates_from_the_template_rendered_prompts(engine):
    """One conversation, or several with one SamplingParams each: the same tokens as generate() on transformers'
    rendering; continue_final_message continues the assistant's last message."""
    tokenizer = engine.tokenizer
    [out] = engine.chat(ASK, GREEDY)
    [want] = engine.generate([template_ids(tokenizer, ASK, add_generation_prompt=True)], GREEDY)
    assert out.token_ids == want.token_ids and out.prompt_token_ids == want.prompt_token_ids
    # the prompt it reports is the rendered conversation, as vLLM's LLM.chat reports it
    assert out.prompt == tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    outs = engine.chat([ASK, CONTINUE], [GREEDY, GREEDY.model_copy(update={"max_tokens": 3})],
                       add_generation_prompt=False, continue_final_message=True)  # fmt: skip
    prompts = [
        template_ids(tokenizer, m, add_generation_prompt=False, continue_final_message=True) for m in (ASK, CONTINUE)
    ]
    wants = engine.generate(prompts, [GREEDY, GREEDY.model_copy(update={"max_tokens": 3})])
    assert [o.token_ids for o in outs] == [w.token_ids for w in wants] and len(outs[1].token_ids) == 3
    assert tokenizer.decode(outs[1].prompt_token_ids).endswith("def add(")  # the message left open


def test_a_given_template_and_its_variables(engine):
    template = "{% for m in messages %}{{ greeting }} {{ m['content'] }}\n{% endfor %}"
    [out] = engine.chat(ASK, GREEDY, chat_template=template, chat_template_kwargs={"greeting": "Hello:"})
    assert engine.tokenizer.decode(out.prompt_token_ids) == out.prompt == "Hello: Reverse a string.\n"


def test_a_tool_conversation_renders_as_the_server_renders_it(engine):
    """An assistant's message that is all tool calls (content None) renders its content as "" and its calls'
    JSON `arguments` as a dict, as the server and vLLM hand them to the template; its `reasoning` as
    `reasoning_content`."""
    from looped_spec.server.chat_template import ChatTemplateConfig, chat_prompt
    from looped_spec.server.protocol import ChatCompletionRequest

    template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}{% for c in m['tool_calls'] or [] %}"
        "[{{ c['function']['name'] }} x={{ c['function']['arguments']['x'] }}]{% endfor %}"
        "{% if m['reasoning_content'] %}({{ m['reasoning_content'] }}){% endif %}{{ '\\n' }}{% endfor %}"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"x": 2}'}}
    messages = [ASK[0], {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "sum it"},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}]  # fmt: skip
    given = copy.deepcopy(messages)
    [out] = engine.chat(messages, GREEDY, chat_template=template)
    assert out.prompt == "user:Reverse a string.\nassistant:[add x=2](sum it)\ntool:4\n"
    served = ChatCompletionRequest(messages=messages, chat_template=template)
    assert out.prompt == chat_prompt(engine.tokenizer, ChatTemplateConfig(trust_request_chat_template=True), served,
                                     None)  # fmt: skip
    assert messages == given  # the caller's messages are left as they were
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not JSON"):
        engine.chat([ASK[0], {"role": "assistant", "content": None, "tool_calls": [
            {**call, "function": {"name": "add", "arguments": "{x"}}]}], GREEDY, chat_template=template)  # fmt: skip


def test_the_reply_ends_at_the_tokenizers_end_of_turn_token(engine, monkeypatch):
    """A chat model's end-of-turn token (the tokenizer's eos, e.g. <|im_end|>) ends the reply even where the model's
    own eos is another token; ignore_eos keeps going. Here the tokenizer's eos is made a token the reply writes."""
    options = dict(add_generation_prompt=False, continue_final_message=True)
    [free] = engine.chat(CONTINUE, SamplingParams(max_tokens=8, temperature=0.0), **options)
    k = next(k for k in range(1, 8) if free.token_ids[k] not in free.token_ids[:k])  # a token new at position k
    turn_end = free.token_ids[k]
    assert turn_end not in engine.adapter.eos_token_ids
    tokenizer = copy.deepcopy(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", tokenizer)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(turn_end)
    assert tokenizer.eos_token_id == turn_end
    [out] = engine.chat(CONTINUE, SamplingParams(max_tokens=8, temperature=0.0), **options)
    assert out.token_ids == free.token_ids[: k + 1] and out.finish_reason == "stop"
    [kept] = engine.chat(CONTINUE, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), **options)
    assert kept.token_ids == free.token_ids


def test_chat_takes_vllms_arguments(engine):
    """vLLM's LLM.chat signature: use_tqdm third, the "string" content format (what "auto" is here), empty
    mm_processor_kwargs; what is not built is a ValueError naming the argument."""
    [want] = engine.chat(ASK, GREEDY)
    [out] = engine.chat(ASK, GREEDY, False, chat_template_content_format="string", mm_processor_kwargs={})
    assert out.token_ids == want.token_ids and out.prompt == want.prompt
    with pytest.raises(ValueError, match="chat_template_content_format='openai': only 'auto' or 'string'"):
        engine.chat(ASK, GREEDY, chat_template_content_format="openai")
    with pytest.raises(ValueError, match="mm_processor_kwargs: not supported"):
        engine.chat(ASK, GREEDY, mm_processor_kwargs={"num_crops": 4})


def test_chat_errors_name_what_is_wrong(engine):
    with pytest.raises(ValueError, match="continue_final_message=True needs add_generation_prompt=False"):
        engine.chat(CONTINUE, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template: the chat template failed on messages: TemplateError: no"):
        engine.chat(ASK, GREEDY, chat_template="{{ raise_exception('no') }}")
    with pytest.raises(ValueError, match=r"chat_template_kwargs\['add_generation_prompt'\]: a rendering parameter"):
        engine.chat(ASK, GREEDY, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match="sampling_params: 1 SamplingParams for 2 conversations"):
        engine.chat([ASK, ASK], [GREEDY])
    with pytest.raises(TypeError, match="messages: one conversation"):
        engine.chat("Reverse a string.", GREEDY)
    with pytest.raises(TypeError, match=r"messages\[1\]\[0\]: a message is a dict"):
        engine.chat([ASK, ["hi"]], GREEDY)
    # named as the caller gave them (the conversation, the message, the argument), never as an index into prompts
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content: not valid Unicode text"):
        engine.chat([{"role": "user", "content": "a\ud800"}], GREEDY)
    with pytest.raises(ValueError, match=r"^messages\[1\]: its rendered prompt has \d+ tokens; max_model_len=256"):
        engine.chat([ASK, [{"role": "user", "content": "hi " * 200}]], GREEDY)
    with pytest.raises(ValueError, match="^messages: the chat template renders an empty prompt"):
        engine.chat(ASK, GREEDY, chat_template="{{ '' }}")
    with pytest.raises(TypeError, match="^chat_template_kwargs: a dict of template variables, got list"):
        engine.chat(ASK, GREEDY, chat_template_kwargs=["enable_thinking"])
    with pytest.raises(TypeError, match="^tools: a list of tools"):
        engine.chat(ASK, GREEDY, tools={"type": "function"})
    # a bad SamplingParams: named as the entry of a list given per conversation, as its field alone when one is given
    top_k = SamplingParams(max_tokens=2, top_k=5)
    with pytest.raises(ValueError, match=r"^sampling_params\[1\]: top_k=5: the temperature is unset"):
        engine.chat([ASK, ASK], [GREEDY, top_k])
    with pytest.raises(ValueError, match="^top_k=5: the temperature is unset"):
        engine.chat([ASK, ASK], top_k)
    with LoopedSpecEngine("tiny-huginn", speculation="off", max_model_len=128) as bare:  # no template of its own
        with pytest.raises(NoChatTemplateError, match="chat_template="):
            bare.chat(ASK, GREEDY)
        [out] = bare.chat(ASK, GREEDY, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
        assert bare.tokenizer.decode(out.prompt_token_ids) == "Reverse a string."
