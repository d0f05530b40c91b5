"""The `looped-spec` command line: every output printed, --stream, prompts from stdin, help, errors."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import types

import pytest

from looped_spec.cli import main

BASE = ["generate", "--model", "tiny-ouro", "--max-tokens", "8", "--speculation", "2,1"]


def test_generate_prints_every_output(capsys):
    assert main(BASE + ["--prompt", "def add(a, b):", "--prompt", "import os\n"]) == 0
    out = capsys.readouterr().out
    assert "--- output 0 ---\ndef add(a, b):" in out and "--- output 1 ---\nimport os\n" in out
    assert "requests                  2" in out


def test_stream_prints_the_same_text_as_generate(capsys):
    assert main(BASE + ["--prompt", "def add(a, b):"]) == 0
    plain = capsys.readouterr().out
    assert main(BASE + ["--prompt", "def add(a, b):", "--stream"]) == 0
    streamed = capsys.readouterr().out
    text = plain.split("\n\n---")[0]
    assert text.startswith("def add(a, b):") and streamed.startswith(text)


def test_prompts_from_stdin_and_compare_plain(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("def add(a, b):\n\nclass A:\n"))
    # every adaptive-only flag: the plain engine beside it takes none of them
    adaptive = ["--speculation", "adaptive", "--policy", "ema", "--preset", "tiny-ouro", "--compare-repeats", "2",
                "--control", '{"readout_budget": 0.02}']  # fmt: skip
    assert main(BASE + ["--prompts-file", "-", "--compare-plain", *adaptive]) == 0
    out = capsys.readouterr().out
    assert "--- output 1 ---\nclass A:" in out
    # two requests: a round's tokens over the batch, and a request's (vLLM readers expect the latter)
    batch, each = map(float, re.search(r"tokens per round\s+([\d.]+) over the batch, ([\d.]+) a request", out).groups())
    assert 1.0 <= each <= batch
    assert re.search(r"\d\.\d\dx (faster|as fast \(slower\))", out) and "outputs identical" in out


def test_compare_plain_rates_tokens_per_second_when_the_outputs_differ_in_length(capsys, monkeypatch):
    """Sampled outputs cut by a stop string: speculation and plain decoding write different numbers of tokens (same
    distribution, other draws). On a clock where every engine takes one second a token, both decode at the same
    speed, and the ratio must say 1.00x, not the ratio of how many tokens each happened to write."""
    import looped_spec.cli.generate as generate_cli
    from looped_spec import LoopedSpecEngine

    clock = [0.0]
    monkeypatch.setattr(generate_cli, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    real, written = LoopedSpecEngine.generate, {}

    def generate(self, *args, **kwargs):
        outputs = real(self, *args, **kwargs)
        tokens = sum(len(o.token_ids) for o in outputs)
        clock[0] += tokens  # one second a token, with or without speculation
        written.setdefault(str(self.speculation), set()).add(tokens)
        return outputs

    monkeypatch.setattr(LoopedSpecEngine, "generate", generate)
    texts = ("def add(a, b):", "import os", "class Stack:", "The river")
    prompts = [arg for text in texts for arg in ("--prompt", text)]
    sampled = ["--max-tokens", "64", "--temperature", "1.0", "--seed", "3", "--stop", "\n", "--compare-repeats", "2"]
    assert main([*BASE, *prompts, *sampled, "--compare-plain"]) == 0
    assert written["2,1"] != written["off"]  # the case at hand: the two wrote different numbers of tokens
    assert "vs plain decoding         1.00x faster [1.00-1.00]" in capsys.readouterr().out


def test_compare_plain_warns_of_differing_outputs_when_the_requests_ran_greedily_only(capsys, monkeypatch, tmp_path):
    """The warning says an engine bug: greedy speculation changed the output. A checkpoint whose
    generation_config.json samples, with no --temperature given, samples (outputs differ by chance: no warning); a
    --temperature below 1e-5 is greedy (a difference is the bug)."""
    import json
    import shutil

    from looped_spec import LoopedSpecEngine
    from looped_spec.models import shipped_model_path

    folder = tmp_path / "sampling-ouro"
    shutil.copytree(shipped_model_path("tiny-ouro"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 1.0}))
    argv = ["generate", "--model", str(folder), "--max-tokens", "16", "--speculation", "2,1", "--prompt", "import os"]
    assert main([*argv, "--seed", "1", "--compare-plain", "--compare-repeats", "1"]) == 0
    out, err = capsys.readouterr()
    assert "outputs differ" in out and "warning" not in err  # sampled: nothing wrong
    real = LoopedSpecEngine.generate

    def broken(self, *args, **kwargs):  # a plain engine that loses a request's last token: outputs that differ
        outputs = real(self, *args, **kwargs)
        for output in outputs if self.speculation == "off" else ():
            output.token_ids = output.token_ids[:-1]
        return outputs

    monkeypatch.setattr(LoopedSpecEngine, "generate", broken)
    assert main([*argv, "--temperature", "1e-6", "--compare-plain", "--compare-repeats", "1"]) == 0
    out, err = capsys.readouterr()
    assert "outputs differ" in out and "warning: greedy speculative output differs from plain decoding" in err


def test_compare_plain_at_a_depth_of_one_is_an_error_not_plain_timed_against_plain(capsys):
    """Huginn at num_steps=1 has nothing to draft with: adaptive decodes plainly there, so --compare-plain would time
    plain decoding against itself and print a speed ratio of noise."""
    argv = ["generate", "--model", "tiny-huginn", "--prompt", "x", "--max-tokens", "2", "--compare-plain"]
    assert main([*argv, "--compare-repeats", "1", "--adapter-option", "num_steps=1"]) == 2
    out, err = capsys.readouterr()
    assert "vs plain decoding" not in out
    assert err.strip() == (
        "looped-spec: error: --compare-plain: times speculation against plain decoding, and the model runs D=1 loop "
        "(--adapter-option num_steps=1), where --speculation adaptive decodes plainly (nothing to draft with)"
    )


def test_a_misspelt_flag_is_told_the_flag_it_was_likely_meant_to_be(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(BASE + ["--prompt", "x", "--temprature", "0.5"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "unrecognized arguments: --temprature 0.5 (did you mean --temperature?)\n" in err
    with pytest.raises(SystemExit):
        main(BASE + ["--prompt", "x", "--xyzzy"])
    assert "unrecognized arguments: --xyzzy\n" in capsys.readouterr().err  # nothing close: no guess


def test_user_errors_are_one_line(capsys):
    assert main(BASE + ["--prompt", "x", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("looped-spec: error: --temperature:") and "\n" not in err and "http" not in err
    assert main(["generate", "--model", "tiny-ouro"]) == 2
    assert "no prompt" in capsys.readouterr().err
    assert main(BASE + ["--prompt", "x", "--min-tokens", "9"]) == 2  # more than --max-tokens 8
    assert "--min-tokens 9 must be at most --max-tokens 8" in capsys.readouterr().err
    assert main(BASE + ["--prompt", "x", "--min-tokens", "8"]) == 0
    assert main(BASE + ["--prompt", "x", "--structured-outputs", '{"regx": "a"}']) == 2
    assert "--structured-outputs: regx: Extra inputs are not permitted" in capsys.readouterr().err
    assert main(BASE + ["--prompt", "x", "--structured-outputs", '{"choice": ["yes", "no"]}']) == 0
    assert capsys.readouterr().out.splitlines()[0] in ("xyes", "xno")


def test_a_preset_naming_a_directory_is_told_so_in_the_commands_terms(capsys, tmp_path):
    assert main([*BASE[:-2], "--prompt", "x", "--preset", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"looped-spec: error: --preset {tmp_path}: a directory, not a preset file (a checkpoint folder's "
                   "own 'preset.json' is found when no preset is given)")  # fmt: skip


def test_an_unknown_adapter_option_and_model_are_named_by_their_flags(capsys):
    argv = ["generate", "--model", "tiny-huginn", "--prompt", "x", "--max-tokens", "2"]
    assert main([*argv, "--adapter-option", "num_step=4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "looped-spec: error: --adapter-option num_step: not an option of huginn_raven (did you mean 'num_steps'?); it "
        "takes: initial_state, num_steps, exit_criterion, exit_threshold"
    )
    assert main([*argv, "--adapter-option", "num_step=4", "--adapter-option", "exit_treshold=1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "looped-spec: error: --adapter-option exit_treshold, num_step: not an option of huginn_raven (did you mean "
        "'exit_threshold' instead of 'exit_treshold' and 'num_steps' instead of 'num_step'?); it takes: initial_state, "
        "num_steps, exit_criterion, exit_threshold"
    )
    assert main(["generate", "--model", "tiny-ouroo", "--prompt", "x"]) == 2
    assert capsys.readouterr().err.startswith("looped-spec: error: --model tiny-ouroo: not a checkpoint folder")


@pytest.mark.parametrize("value", ["0.5", "2.0", "true", "two"])
def test_generate_and_tune_parse_adapter_options_alike(value, capsys, tmp_path):
    """One parser (JSON scalars, else strings) for both commands; the adapter accepts only a true integer."""
    option = ["--adapter-option", f"num_steps={value}"]
    assert main(["generate", "--model", "tiny-huginn", "--prompt", "x", *option]) == 2
    generate_error = capsys.readouterr().err
    assert main(["tune", "--model", "tiny-huginn", "--out", str(tmp_path / "p.json"), "--quiet", *option]) == 2
    tune_error = capsys.readouterr().err
    assert generate_error == tune_error
    assert generate_error.startswith("looped-spec: error: --adapter-option num_steps=")
    assert "must be a positive integer" in generate_error


def test_tune_at_a_depth_of_one_names_the_adapter_option_flag(capsys, tmp_path):
    argv = ["tune", "--model", "tiny-huginn", "--out", str(tmp_path / "p.json"), "--quiet"]
    assert main([*argv, "--adapter-option", "num_steps=1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "looped-spec: error: --adapter-option num_steps=1: the model has full depth D=1; self-speculation needs D >= 2"
    )
    assert not (tmp_path / "p.json").exists()


def test_help_and_version_do_not_import_torch():
    code = (
        "import sys\nfrom looped_spec.cli import main\n"
        "for argv in (['--help'], ['serve', '--help'], ['--version']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # argparse wraps help lines
    assert "--api-key" in out and "(default: 127.0.0.1)" in out and "looped-spec 0.1.0" in out


@pytest.mark.parametrize("argv", [["serve", "--port", "nope"], ["generate", "--max-tokens", "x"]])
def test_bad_flags_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


def test_every_flag_has_help():
    import argparse

    from looped_spec.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [(name, action.dest) for name, sub in subparsers.choices.items() for action in sub._actions
               if action.help is None]  # fmt: skip
    assert not missing


def test_cuda_graphs_flag_reaches_the_engine(capsys):
    """--cuda-graphs maps onto EngineConfig.cuda_graphs; with --batching loop, "emulate" runs the captured-pass path
    (on the CPU through the kernel's torch stand-in) and prints the same text as eager passes; "on" without CUDA is
    the engine's one-line error naming the option."""
    loop = BASE + ["--prompt", "def add(a, b):", "--batching", "loop"]
    assert main(loop) == 0
    eager = capsys.readouterr().out.split("\n\n---")[0]
    assert main(loop + ["--cuda-graphs", "emulate"]) == 0
    assert capsys.readouterr().out.split("\n\n---")[0] == eager
    assert main(loop + ["--cuda-graphs", "on"]) == 2
    assert "--cuda-graphs on needs a CUDA device" in capsys.readouterr().err


def test_token_id_prompts_from_jsonl_print_as_ids(capsys, tmp_path):
    """Token ids are the only way to run a checkpoint without a tokenizer: a .jsonl 'prompt' may be a list of ids,
    printed (and streamed) as ids; anything else is refused naming the line."""
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n')
    fixture = ["generate", "--model", "tests/fixtures/ouro-tiny", "--max-tokens", "4", "--speculation", "off",
               "--prompts-file", str(prompts), "--ignore-eos"]  # fmt: skip
    assert main(fixture) == 0
    printed = capsys.readouterr().out.split("\n")[0]
    assert main(fixture + ["--stream"]) == 0
    streamed = capsys.readouterr().out.split("\n")[0]
    ids = printed.split()
    assert len(ids) == 7 and ids[:3] == ["1", "2", "3"] and all(t.isdigit() for t in ids) and streamed == printed
    prompts.write_text('{"prompt": 5}\n')
    assert main(fixture) == 2
    assert f"{prompts}:1: 'prompt' must be text or a list of token ids" in capsys.readouterr().err


def test_text_for_a_model_without_tokenizer_names_the_flag(capsys, tmp_path):
    """Text given to a checkpoint without tokenizer files is an error naming the flag that gave it and how to give token
    ids from the command line, not the engine's `prompts[0]` or `stop_token_ids`, which no flag sets."""
    fixture = ["generate", "--model", "tests/fixtures/ouro-tiny", "--max-tokens", "4", "--speculation", "off"]
    assert main(fixture + ["--prompt", "def f"]) == 2
    err = capsys.readouterr().err
    assert "--prompt 'def f': the model has no tokenizer files" in err and '{"prompt": [1, 2, 3]}' in err
    text = tmp_path / "prompts.txt"
    text.write_text("def f\n")
    assert main(fixture + ["--prompts-file", str(text)]) == 2
    assert f"--prompts-file {text}: prompt 1 is text" in capsys.readouterr().err
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"prompt": [1, 2, 3]}\n')
    assert main(fixture + ["--prompts-file", str(ids), "--stop", "x"]) == 2
    err = capsys.readouterr().err
    assert "--stop 'x': stop strings need the model's tokenizer files" in err and "stop_token_ids" not in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["serve", "--threads", "-1"], "--threads -1: must be >= 0"),
        (["serve", "--port", "99999"], "--port 99999: must be in 0..65535"),
        (["serve", "--max-body-bytes", "0"], "--max-body-bytes 0: must be >= 1"),
        (BASE + ["--prompt", "x", "--compare-repeats", "3"], "--compare-repeats: only with --compare-plain"),
        (BASE + ["--prompts-file", "/no/such/file"], "--prompts-file /no/such/file: No such file"),
        (BASE + ["--prompt", "x", "--preset", "tiny-ouro"], "--preset tiny-ouro: only with --speculation adaptive"),
        (BASE + ["--prompt", "x", "--exit-at-step", "2", "--exit-threshold", "0.5"],
         "error: --exit-threshold 0.5 and --exit-at-step 2"),
        # no shipped model sets a default threshold: without an exit flag no token exits, and the mode does nothing
        (BASE + ["--prompt", "x", "--early-exit", "select"],
         "error: --early-exit select: no token exits early, so it would change nothing"),
        # an exit flag that exits no token early is told as such, not as missing
        (["generate", "--model", "tiny-huginn", "--prompt", "x", "--adapter-option", "num_steps=4", "--exit-at-step",
          "4", "--early-exit", "skip"], "nothing (--exit-at-step 4 is the model's full depth D=4)"),
        (BASE + ["--prompt", "x", "--exit-threshold", "1.0", "--early-exit", "skip"],
         "nothing (--exit-threshold 1.0 never exits before the model's D=4 loops)"),
        # the temperature left unset decodes greedily: a sampling filter would do nothing
        (BASE + ["--prompt", "x", "--top-p", "0.9"], "error: --top-p 0.9: the temperature is unset, so the request "
         "decodes greedily"),
        (["generate", "--model", "tiny-ouroo", "--prompt", "x"], "shipped: tiny-huginn"),
        (["tune", "--model", "tiny-ouro", "--out", "/tmp/x.json", "--cost-from", "tiny-huginn"],
         "--cost-from tiny-huginn: its cost profile was measured on model 'tiny-huginn', not 'tiny-ouro'"),
        (["tune", "--model", "tiny-ouro", "--out", "/tmp/x.json", "--cost-from", "tiny-ouro", "--repeats", "9"],
         "--repeats: times rounds, which --cost-from skips"),
        (["generate", "--model", "tiny-huginn", "--prompt", "x", "--adapter-option", "num_steps=4",
          "--adapter-option", "num_steps=12"], "num_steps is given twice"),
        (["generate", "--model", "tiny-huginn", "--prompt", "x", "--adapter-option", "num_steps"],
         "--adapter-option 'num_steps': expected KEY=VALUE"),
        # a fixed plan at a depth of one: the flag that asked for it is named
        (["generate", "--model", "tiny-huginn", "--prompt", "x", "--adapter-option", "num_steps=1", "--speculation",
          "3,1"], "error: --speculation: (k=3, d=1): the model runs D=1 loop"),
    ],
)  # fmt: skip
def test_flags_that_cannot_work_are_one_line_errors_before_any_work(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "\n" not in err.strip() and "Value error" not in err, err


def test_the_speed_ratio_never_calls_a_slowdown_faster(capsys):
    from looped_spec.cli import speed_ratio

    assert speed_ratio(1.57) == "1.57x faster" and speed_ratio(0.73) == "0.73x as fast (slower)"
    assert main(BASE + ["--prompt", "x", "--max-tokens", "3"]) == 0
    assert "finish reasons            length: 1" in capsys.readouterr().out


def test_prefix_caching_flag_shares_a_prompt_start(capsys):
    """--prefix-caching reaches the engine: prompts run one after another (--stream), the second finds the start the
    first computed, and the summary says how many prompt tokens came from the cache."""
    start = "You are a careful assistant who writes short Python. " * 2
    argv = BASE + ["--prompt", start + "def add(a, b):", "--prompt", start + "import os\n", "--stream"]
    assert main(argv + ["--prefix-caching"]) == 0
    cached = capsys.readouterr().out
    hits, queries = map(int, re.search(r"prompt tokens from the prefix cache\s+(\d+)/(\d+)", cached).groups())
    assert 0 < hits < queries
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert "prefix cache" not in plain and plain.split("\n\n---")[0] == cached.split("\n\n---")[0]


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"prompt": "hi"', ":1: not valid JSON (Expecting ',' delimiter at column 16)"),
        ('{"text": "hi"}', ":1: expected a JSON object with a 'prompt' field"),
        ('["hi"]', ":1: expected a JSON object with a 'prompt' field"),
        ('{"prompt": "hi", "max_tokens": 3}', ":1: 'max_tokens': a line holds only 'prompt' (the flags set the rest)"),
    ],
)
def test_a_bad_jsonl_prompt_line_says_what_is_wrong_with_it(line, message, capsys, tmp_path):
    """A line that is not JSON says so (with the parser's position), apart from JSON that lacks the field."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(line + "\n")
    assert main(BASE + ["--prompts-file", str(prompts)]) == 2
    assert capsys.readouterr().err.strip() == f"looped-spec: error: {prompts}{message}"


def test_a_long_prompt_gets_only_our_error_not_transformers_warning(capfd):
    """The engine enforces max_model_len (one error naming the flag); the tokenizer's own 1024-token limit would
    add transformers' "Token indices sequence length ..." warning first, on stderr, for the server's tokenizer too."""
    from looped_spec.engine.inputs import load_tokenizer
    from looped_spec.models import shipped_model_path

    assert main(BASE + ["--prompt", "hello world " * 600]) == 2
    err = capfd.readouterr().err
    assert "Token indices sequence length" not in err and err.count("\n") == 1, err
    assert "has 4201 tokens" in err
    load_tokenizer(shipped_model_path("tiny-ouro"))("hello world " * 600)  # the load site the server uses as well
    assert "Token indices" not in capfd.readouterr().err


def test_stats_say_when_no_decode_round_ran_and_grammars_speculate(capsys):
    """An output that ends with the token its prefill samples runs no decode round: the table says so instead of
    '0.00' tokens per round and an empty plans row. A grammar does not turn speculation off: its rounds draft."""
    regex = ["--structured-outputs", '{"regex": "[a-z]+"}', "--prompt", "Name:"]
    assert main(BASE + regex + ["--max-tokens", "1"]) == 0
    rows = dict(re.findall(r"^(tokens per round|plans used \(K,d: rounds\))\s+(.*)$", capsys.readouterr().out, re.M))
    assert set(rows.values()) == {"none: every output ended with the token its prefill gave"}, rows
    assert main(BASE + regex + ["--max-tokens", "16"]) == 0
    out = capsys.readouterr().out
    speculative = int(re.search(r"decode rounds\s+\d+ \((\d+) speculative\)", out).group(1))
    drafted = int(re.search(r"draft tokens accepted\s+\d+/(\d+)", out).group(1))
    assert speculative > 0 and drafted >= speculative and re.search(r"plans used \(K,d: rounds\).*2,1: \d", out)


def test_tokens_per_round_count_only_the_tokens_rounds_committed(capsys):
    """A preempted request's recompute samples its next token at the end of a prefill, as its first token was: those
    tokens are no round's, so tokens per round (over the batch and a request) leave them out."""
    from looped_spec import LoopedSpecEngine, SamplingParams

    prompts, kv = ["Hello there", "The cat sat on", "x"], {"num_kv_blocks": 6, "block_size": 4, "max_model_len": 24}
    engine = LoopedSpecEngine("tiny-ouro", speculation="2,1", **kv)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert engine.stats.num_preemptions > 0
    # each round commits its accepted drafts and one more (no stop ends a request inside a round here)
    round_tokens = sum(o.metrics.rounds + o.metrics.num_accepted_tokens for o in outs)
    request_rounds = sum(o.metrics.rounds for o in outs)
    argv = ["generate", "--model", "tiny-ouro", "--speculation", "2,1", "--max-tokens", "16", "--temperature", "0",
            "--ignore-eos", *(f"--{key.replace('_', '-')}={value}" for key, value in kv.items())]  # fmt: skip
    assert main([*argv, *(arg for prompt in prompts for arg in ("--prompt", prompt))]) == 0
    out = capsys.readouterr().out
    batch, each = map(float, re.search(r"tokens per round\s+([\d.]+) over the batch, ([\d.]+) a request", out).groups())
    assert batch == round(round_tokens / engine.stats.num_rounds, 2)
    assert each == round(round_tokens / request_rounds, 2)
