"""lm-evaluation-harness as a real client (issue 37): `local-completions` against the server, with a small local task
file and no network, runs a loglikelihood task and a generate_until task to the end, and its loglikelihoods equal
ones computed offline from the model's own logits (`LoopedSpecEngine.score`), on a speculating server;
`local-chat-completions` runs a generate_until task through the chat template, its answers the offline engine's
`chat`."""

from __future__ import annotations

import json

import lm_eval  # a dev dependency: pip install -e ".[dev]"
import pytest
from server_utils import ServerThread

from looped_spec import LoopedSpecEngine, SamplingParams
from looped_spec.models import shipped_model_path

DOCS = [
    {"context": "def fibonacci(n):\n", "continuation": "    if n"},
    {"context": "import os\nimport", "continuation": " sys"},
    {"context": "class Stack:\n    def", "continuation": " __init__(self"},
    {"context": "for i in range(", "continuation": "10):"},
]


def task_files(folder) -> None:
    (folder / "data.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'data.jsonl'}\ntest_split: test\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\n'
    )
    (folder / "tiny_ll.yaml").write_text(
        "task: tiny_ll\noutput_type: loglikelihood\n" + common
        + "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )  # fmt: skip
    (folder / "tiny_gen.yaml").write_text(
        "task: tiny_gen\noutput_type: generate_until\n" + common
        + 'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 6\n'
        + "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )  # fmt: skip


@pytest.mark.slow
def test_lm_eval_local_completions_runs_and_its_loglikelihoods_equal_the_models(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    for flag in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(flag, "1")
    task_files(tmp_path)
    folder = shipped_model_path("tiny-ouro")
    engine = LoopedSpecEngine("tiny-ouro", speculation="2,1", max_model_len=128)
    offline = LoopedSpecEngine("tiny-ouro", speculation="off", max_model_len=128)
    with ServerThread(engine, "tiny-ouro") as server:
        args = (f"base_url={server.url}/v1/completions,model=tiny-ouro,tokenizer_backend=huggingface,"
                f"tokenizer={folder},num_concurrent=1,max_retries=1")  # fmt: skip
        results = lm_eval.simple_evaluate(
            model="local-completions", model_args=args, tasks=["tiny_ll", "tiny_gen"],
            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False), log_samples=True,
        )  # fmt: skip
    assert set(results["results"]) == {"tiny_ll", "tiny_gen"}
    tokenizer = offline.tokenizer
    for sample in results["samples"]["tiny_ll"]:
        context, continuation = sample["doc"]["context"], sample["doc"]["continuation"]
        # the harness moves the context's trailing whitespace into the continuation, and tokenizes them apart
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ids = tokenizer.encode(context, add_special_tokens=False)
        scores = offline.score(ids + tokenizer.encode(continuation, add_special_tokens=False), 1, seed=1234)
        expected = sum(entry.logprob for entry in scores[len(ids) :])
        greedy = all(entry.logprob == entry.top[0][1] for entry in scores[len(ids) :])
        loglikelihood, is_greedy = sample["resps"][0][0]
        assert loglikelihood == pytest.approx(expected, abs=1e-4) and is_greedy == greedy, context
    for sample in results["samples"]["tiny_gen"]:
        text = offline.generate(sample["doc"]["context"], SamplingParams(max_tokens=6, stop=["\n\n"]))[0].text
        assert sample["resps"][0][0] == text


@pytest.mark.slow
def test_lm_eval_local_chat_completions_answers_as_the_offline_chat(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    for flag in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(flag, "1")
    task_files(tmp_path)
    # sampled (the tiny code model answers a chat turn greedily with newlines only), with a stop it never writes: the
    # answers are max_gen_toks tokens long and differ from prompt to prompt
    chat_task = (tmp_path / "tiny_gen.yaml").read_text().replace("tiny_gen", "tiny_chat").replace("\\n\\n", "###")
    (tmp_path / "tiny_chat.yaml").write_text(
        chat_task.replace("max_gen_toks: 6", "max_gen_toks: 8\n  temperature: 1.0")
    )
    engine = LoopedSpecEngine("tiny-ouro", speculation="2,1", max_model_len=256)
    offline = LoopedSpecEngine("tiny-ouro", speculation="2,1", max_model_len=256)  # a seed's draws: the same plan
    with ServerThread(engine, "tiny-ouro") as server:
        args = f"base_url={server.url}/v1/chat/completions,model=tiny-ouro,num_concurrent=1,max_retries=1"
        results = lm_eval.simple_evaluate(
            model="local-chat-completions", model_args=args, tasks=["tiny_chat"], apply_chat_template=True,
            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False), log_samples=True,
        )  # fmt: skip
    samples = results["samples"]["tiny_chat"]
    assert len(samples) == len(DOCS)
    answers = [sample["resps"][0][0] for sample in samples]
    for sample, answer in zip(samples, answers):
        messages = [{"role": "user", "content": sample["doc"]["context"]}]
        [expected] = offline.chat(messages, SamplingParams(max_tokens=8, temperature=1.0, stop=["###"], seed=1234))
        assert answer == expected.text
    assert len(set(answers)) > 1 and all(answers)
