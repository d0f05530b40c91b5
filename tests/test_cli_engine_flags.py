"""The engine flags generate and serve share: KV cache and scheduling limits and the controller's tunables reach
EngineConfig, errors name the flag, and --log-level shows looped-spec's own log lines on stderr."""

from __future__ import annotations

import json

import pytest

import looped_spec
from looped_spec.cli import main
from looped_spec.control.settings import ControlSettings
from looped_spec.execution.kv_cache import KVCache

BASE = ["generate", "--model", "tiny-ouro", "--max-tokens", "4", "--prompt", "def add(a, b):"]


@pytest.fixture
def engines(monkeypatch) -> list:
    """The engines the command builds (generate and serve import LoopedSpecEngine from looped_spec when they run),
    each with the KV blocks and block bytes it was built with (generate closes its engine, which frees them)."""
    built = []

    class Recorded(looped_spec.LoopedSpecEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.built_kv_blocks = self.kv.num_blocks
            self.block_bytes = KVCache.bytes_per_block(
                self.adapter.kv_layout, self.config.block_size, self.adapter.dtype
            )
            built.append(self)

    monkeypatch.setattr(looped_spec, "LoopedSpecEngine", Recorded)
    return built


def test_limit_flags_reach_the_engine(engines, capsys):
    tunables = {"decision_interval": 8, "hysteresis": 0.1}
    argv = BASE + ["--speculation", "adaptive", "--block-size", "8", "--max-num-batched-tokens", "16",
                   "--num-kv-blocks", "300", "--control", json.dumps(tunables)]  # fmt: skip
    assert main(argv) == 0
    config = engines[-1].config
    assert (config.block_size, config.max_num_batched_tokens, config.num_kv_blocks) == (8, 16, 300)
    assert config.control == ControlSettings(**tunables) and engines[-1].built_kv_blocks == 300
    assert main(BASE + ["--speculation", "2,1", "--kv-cache-memory-gb", "0.05"]) == 0
    engine = engines[-1]
    assert engine.config.kv_cache_memory_gb == 0.05
    assert engine.built_kv_blocks == int(0.05 * 2**30) // engine.block_bytes  # fewer than a full batch would need
    assert main(BASE + ["--speculation", "2,1", "--batching", "loop", "--max-pass-positions", "3"]) == 0
    assert engines[-1].config.max_pass_positions == 3
    capsys.readouterr()


def test_serve_takes_the_same_flags_and_logs_its_startup_at_info(engines, capsys, monkeypatch):
    """serve's default --log-level info shows the preset chosen and the engine's summary before uvicorn's lines
    (here the server is not started: `serve` is replaced by a recorder)."""
    served = {}
    monkeypatch.setattr("looped_spec.server.launch.serve", lambda engine, name, **kw: served.update(kw, name=name))
    assert main(["serve", "tiny-ouro", "--num-kv-blocks", "80", "--block-size", "32", "--max-num-batched-tokens",
                 "64", "--scheduling-policy", "priority", "--return-tokens-as-token-ids"]) == 0  # fmt: skip
    config = engines[-1].config
    assert (config.num_kv_blocks, config.block_size, config.max_num_batched_tokens) == (80, 32, 64)
    assert config.scheduling_policy == "priority"
    assert served["log_level"] == "info" and served["name"] == "tiny-ouro" and served["return_tokens_as_token_ids"]
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert any(
        line.startswith("INFO ") and "[looped_spec.presets.lookup] adaptive preset for" in line for line in lines
    )
    assert any("[looped_spec.engine.engine] engine: tiny-ouro (ouro, D=4) on cpu, float32; KV cache 80 blocks x 32 "
               "tokens" in line for line in lines), lines  # fmt: skip
    assert main(["serve", "tiny-ouro", "--log-level", "warning"]) == 0
    assert served["log_level"] == "warning" and "INFO" not in capsys.readouterr().err


def test_generate_logs_only_warnings_unless_asked_and_never_on_stdout(capsys):
    """generate's stdout is its output (parsed by scripts): its default --log-level warning adds nothing for a run
    that goes well; --log-level info shows the startup lines on stderr, and stdout stays the same."""
    argv = BASE + ["--speculation", "2,1"]
    assert main(argv) == 0
    quiet = capsys.readouterr()
    assert quiet.err == ""
    assert main(argv + ["--log-level", "info"]) == 0
    told = capsys.readouterr()
    assert told.out == quiet.out
    assert "[looped_spec.engine.engine] engine: tiny-ouro (ouro, D=4) on cpu" in told.err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--speculation", "3,9"], "--speculation: d=9: must be in 1..3 (the model's full depth is D=4)"),
        (["--speculation", "3,x"], "--speculation 3,x: use off, adaptive or K,d (e.g. 3,1"),
        (["--speculation", "²,1"], "--speculation ²,1: use off, adaptive or K,d (e.g. 3,1"),  # a digit to isdigit()
        (["--structured-outputs", '{"json": {"type": "objekt"}}'], "--structured-outputs: json: Invalid type: objekt"),
        (["--max-batch-size", "0"], "--max-batch-size 0: Input should be greater than or equal to 1"),
        (["--dtype", "float8"], "--dtype float8: not supported; use one of auto, float32, bfloat16, float16"),
        (["--speculation", "off", "--policy", "ema"],
         "--policy ema: only with --speculation adaptive (--speculation off runs no adaptive controller)"),
        (["--speculation", "off", "--policy", "goodput"], "--policy goodput: only with --speculation adaptive"),
        (["--num-kv-blocks", "10"], "--num-kv-blocks 10 cannot hold one request of --max-model-len 1024"),
        (["--block-size", "65536", "--num-kv-blocks", "1000000000"],  # past any address space: never allocated
         "--num-kv-blocks 1000000000: 1000000000 blocks of 65536 tokens"),
        (["--kv-cache-memory-gb", "0"], "--kv-cache-memory-gb 0.0: must be a finite number of GiB > 0"),
        (["--kv-cache-memory-gb", "1", "--num-kv-blocks", "100"],
         "--num-kv-blocks 100, --kv-cache-memory-gb 1.0: set at most one"),
        (["--block-size", "0"], "--block-size 0: Input should be greater than or equal to 1"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens 0: Input should be greater than or equal to 1"),
        (["--max-pass-positions", "4"], "--max-pass-positions 4: a loop-pass budget, it needs --batching loop"),
        (["--control", '{"decision_interval": 8'], "--control: not valid JSON (Expecting ',' delimiter at column 24)"),
        (["--control", "[8]"], "--control: must be a JSON object, got '[8]'"),
        (["--control", '{"decision_intervall": 8}'], "--control: decision_intervall: unknown field (did you mean "
         "'decision_interval'?"),
        (["--control", '{"decision_interval": 0}'], "--control: decision_interval=0 must be in [1, inf)"),
        (["--speculation", "2,1", "--control", "{}"],
         "--control {} (no tunable set away from its default): only with --speculation adaptive"),
        (["--speculation", "2,1", "--control", '{"hysteresis": 0.5}'],
         "--control {'hysteresis': 0.5}: only with --speculation adaptive"),
        (["--temperature", "-1"], "--temperature: Input should be greater than or equal to 0"),
        (["--min-tokens", "9"], "--min-tokens 9 must be at most --max-tokens 4"),
        (["--threads", str(2**40)], "--threads 1099511627776: more than torch takes (Overflow"),
    ],
)  # fmt: skip
def test_errors_name_the_flag(flags, message, capsys):
    assert main(BASE + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("looped-spec: error: --") and message in err and err.count("\n") == 1, err


def test_field_names_become_flags_only_where_they_name_a_field():
    from looped_spec.cli.flag_errors import name_flags

    flags = {"device": "--device", "cuda_graphs": "--cuda-graphs", "max_model_len": "--max-model-len"}
    message = "cuda_graphs=True needs a CUDA device (cuda_graphs='emulate' runs the path on any device)"
    assert name_flags(message, flags) == "--cuda-graphs on needs a CUDA device (--cuda-graphs emulate runs the path " \
        "on any device)"  # fmt: skip
    assert (
        name_flags("/srv/max_model_len/x: lower max_model_len", flags) == "/srv/max_model_len/x: lower --max-model-len"
    )
    assert name_flags("the device: cpu", flags) == "the --device: cpu"  # the form a field is named in
    assert name_flags("a device for it", flags) == "a device for it"
    # a field with parts names one as `field.part`; another field's name before a dot is a word (a file's name), and
    # `field=` without a value is prose
    flags |= {"preset": "--preset", "speculation": "--speculation"}
    assert name_flags("speculation.k=65: must be at most 64", flags) == "--speculation: k=65: must be at most 64"
    message = "a directory (its own preset.json is found without preset=)"
    assert name_flags(message, flags) == message
    # an adapter's own option is set with --adapter-option, even where a flag of its name sets a request field
    flags["exit_threshold"] = "--exit-threshold"
    message = "adapter option exit_threshold=-1 must be > 0 (the default early-exit threshold of requests)"
    assert name_flags(message, flags) == "--adapter-option " + message.removeprefix("adapter option ")
    message = "unknown huginn_raven adapter option(s) ['num_step']; it takes: num_steps, exit_threshold"
    assert name_flags(message, flags) == message


def test_every_flag_states_its_default():
    """--help shows each flag's default: argparse prints it, or (a default of None) the help says it in words."""
    import argparse

    from looped_spec.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = [(name, action.dest) for name, sub in subparsers.choices.items() for action in sub._actions
              if action.default is None and action.option_strings and "default" not in (action.help or "")
              and action.required is False]  # fmt: skip
    assert not silent
    # each default said once, and none for an on/off switch (off unless given)
    for name, sub in subparsers.choices.items():
        text = sub.format_help()
        assert "(default: False)" not in text and "(default: True)" not in text, name
        for action in sub._actions:
            shown = sub._get_formatter()._get_help_string(action) or ""
            assert shown.count("(default:") <= 1, (name, action.dest, shown)


def test_batch_size_copies_decode_together_and_stream_runs_them_one_at_a_time(engines, capsys):
    """What --batch-size and --stream say they do: N copies of every prompt, decoded in one batch; under --stream
    each request runs alone. The copies share --seed: sampled ones are the same text too."""
    argv = BASE[:-2] + ["--prompt", "a", "--prompt", "b", "--batch-size", "3", "--temperature", "1"]
    assert main(argv) == 0
    outputs = capsys.readouterr().out.split("\n\n---")[0].split("--- output ")[1:]
    assert len(outputs) == 6 and len({o.split("\n", 1)[1].strip() for o in outputs}) == 2  # copies of a and b
    assert max(engines[-1].stats.batch_size_histogram) == 6
    assert main(argv + ["--stream"]) == 0
    assert capsys.readouterr().out.count("--- output ") == 6 and set(engines[-1].stats.batch_size_histogram) == {1}


def test_each_command_helps_with_its_own_seed():
    import argparse

    from looped_spec.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    seed = {name: next(a.help for a in subparsers.choices[name]._actions if a.dest == "seed") for name in
            ("generate", "serve")}  # fmt: skip
    assert "prompt" not in seed["serve"] and "--batch-size" not in seed["serve"] and "request" in seed["serve"]
    assert "every prompt" in seed["generate"] and "--batch-size" in seed["generate"]


def argparse_error(argv: list[str], capsys) -> str:
    """The error line argparse prints (after the usage) for an argument the command does not take, exit status 2."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


SERVE = ["serve", "tiny-ouro"]


@pytest.mark.parametrize(
    ("given", "answer"),
    [
        (["--max-num-seqs", "8"], "--max-num-seqs: vLLM's flag; here --max-batch-size (the most requests decoding at "
         "once)"),
        (["--max_num_seqs=8"], "--max_num_seqs: vLLM's flag; here --max-batch-size"),  # vLLM reads _ as -
        (["--enforce-eager"], "--enforce-eager: vLLM's flag; here --cuda-graphs off (run every step eagerly)"),
        (["--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization: vLLM's flag; here the KV cache is sized by "
         "--kv-cache-memory-gb (GiB) or --num-kv-blocks (default: half the free GPU memory)"),
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size: vLLM's flag; one engine runs on one device here; "
         "serve --replicas N scales out with Ray Serve"),
        (["-tp", "2"], "-tp: vLLM's flag; one engine runs on one device here"),
        (["--trust-remote-code"], "--trust-remote-code: vLLM's flag; never needed here: looped-spec runs no "
         "checkpoint code"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype: vLLM's flag; here the KV cache is in the model's dtype "
         "(--dtype float32, bfloat16 or float16); no other is offered"),
        (["--quantization", "awq"], "--quantization: vLLM's flag; no quantized weights here"),
        (["--tokenizer", "x"], "--tokenizer: vLLM's flag; here the checkpoint folder's own tokenizer files"),
        (["--max-logprobs", "5"], "--max-logprobs: vLLM's flag; here fixed at vLLM's default 20"),
        (["--num-gpu-blocks-override", "9"], "--num-gpu-blocks-override: vLLM's flag; here --num-kv-blocks (the KV "
         "cache's blocks, on any device)"),
        (["--enable-chunked-prefill"], "--enable-chunked-prefill: vLLM's flag; here always on: a prompt longer than "
         "--max-num-batched-tokens is prefilled in chunks"),
        (["--enable-prefix-caching"], "--enable-prefix-caching: vLLM's flag; here --prefix-caching, off by default"),
        (["--speculative-config", '{"method": "ngram"}'], "--speculative-config: vLLM's flag; here --speculation "
         "adaptive (the default"),
        (["--num-speculative-tokens", "4"], "--num-speculative-tokens: vLLM's flag; here --speculation K,d"),
        (["--download-dir", "/x"], "--download-dir: vLLM's flag; nothing is downloaded here"),
        (["--enable-lora"], "--enable-lora: vLLM's flag; not offered: no LoRA adapters here"),
        (["--swap-space", "4"], "--swap-space: vLLM's flag; not offered: a preempted request's KV is recomputed"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", [BASE, SERVE])
def test_a_vllm_engine_flag_says_what_stands_for_it(command, given, answer, capsys):
    """EngineConfig's VLLM_OPTIONS, its fields named as the command's flags (argparse's error, exit status 2)."""
    err = argparse_error(command + given, capsys)
    assert err.startswith(f"looped-spec {command[0]}: error: {answer}"), err
    assert "unrecognized arguments" not in err and "max_batch_size" not in err, err


def test_a_vllm_flag_beside_a_misspelt_one_says_both(capsys):
    err = argparse_error(SERVE + ["--max-num-seqs", "8", "--prot", "9000"], capsys)
    assert err == ("looped-spec serve: error: --max-num-seqs: vLLM's flag; here --max-batch-size (the most requests "
                   "decoding at once); unrecognized arguments: --prot 9000 (did you mean --port?)")  # fmt: skip
    err = argparse_error(BASE + ["--enforce-eager", "--xyzzy"], capsys)
    assert err.endswith("(run every step eagerly); unrecognized arguments: --xyzzy"), err


@pytest.mark.parametrize(
    ("given", "left"),
    [
        (["--enforce-eager", "extra"], "extra"),  # a switch: the argument after it is none of its
        (["--max-num-seqs=8", "extra"], "extra"),  # its value given with =
        (["--max-num-seqs", "8", "extra", "more"], "extra more"),  # one value
        (["-tp=2", "extra"], "extra"),
    ],
)  # fmt: skip
def test_an_argument_after_a_vllm_flag_and_its_value_is_still_named(given, left, capsys):
    """Only a vLLM flag's own value goes with it: a switch takes none, `--flag=value` has it, the others one; any
    further argument is argparse's unrecognized one (it was dropped from the error, unnamed)."""
    err = argparse_error(SERVE + given, capsys)
    assert err.endswith(f"; unrecognized arguments: {left}"), err


@pytest.mark.parametrize("command", [BASE, SERVE])
def test_an_unknown_flag_is_argparse_s_error_with_the_flag_it_was_likely_meant_to_be(command, capsys):
    prog = f"looped-spec {command[0]}: error:"
    # the flag named once (it said "--prefix-caching for --prefix-cashing")
    err = argparse_error(command + ["--prefix-cashing"], capsys)
    assert err == f"{prog} unrecognized arguments: --prefix-cashing (did you mean --prefix-caching?)"
    err = argparse_error(command + ["--max-bacth-size", "4", "--block-sise", "8"], capsys)  # several: which is which
    assert err == (f"{prog} unrecognized arguments: --max-bacth-size 4 --block-sise 8 (did you mean --max-batch-size "
                   "instead of --max-bacth-size and --block-size instead of --block-sise?)")  # fmt: skip
    assert argparse_error(command + ["--xyzzy", "1"], capsys) == f"{prog} unrecognized arguments: --xyzzy 1"


def test_vllm_serve_flags_are_told_only_where_serve_has_the_engine_flags(capsys):
    """A vLLM flag of `vllm serve`'s own is no flag of generate (vLLM has no generate), nor tune's: argparse's plain
    error there; tune builds engines but has none of the engine flags the answers name."""
    err = argparse_error(BASE + ["--uvicorn-log-level", "info"], capsys)
    assert err == "looped-spec generate: error: unrecognized arguments: --uvicorn-log-level info"
    err = argparse_error(["tune", "--model", "tiny-ouro", "--out", "x.json", "--max-num-seqs", "8"], capsys)
    assert err == "looped-spec tune: error: unrecognized arguments: --max-num-seqs 8"
