"""`looped-spec serve` / `generate` flag combinations that would be ignored or mean nothing are usage errors naming
the flags, before the engine loads or Ray starts; `serve --model` is the positional model, as in `vllm serve`.
Nothing is served: the engine, the server and the replicas' launch are replaced by recorders."""

from __future__ import annotations

import pytest

import looped_spec
from looped_spec.cli import main


@pytest.fixture
def launched(monkeypatch) -> dict:
    """What `serve` would start: the model the engine is built from, the server's keywords, the replicas' args."""
    recorded: dict = {}

    class NoEngine:
        def __init__(self, model, **options):
            recorded["model"] = model

    monkeypatch.setattr(looped_spec, "LoopedSpecEngine", NoEngine)
    monkeypatch.setattr("looped_spec.server.launch.serve",
                        lambda engine, name, **kw: recorded.update(kw, name=name, served=True))  # fmt: skip
    monkeypatch.setattr("looped_spec.server.replicas.run_replicas",
                        lambda args, host, port: recorded.update(replica_args=args))  # fmt: skip
    return recorded


def usage_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("looped-spec: error: ") and err.count("\n") == 1, err
    return err


def test_a_tool_call_parser_without_auto_tool_choice_is_an_error(launched, capsys):
    """Only tool_choice "auto" runs the parser ("required" and a named function are constrained JSON)."""
    for replicas in ([], ["--replicas", "2"]):
        err = usage_error(["serve", "tiny-ouro", "--tool-call-parser", "hermes", *replicas], capsys)
        assert "--tool-call-parser hermes: only with --enable-auto-tool-choice" in err
    assert launched == {}  # neither the engine nor the server nor Ray
    assert main(["serve", "tiny-ouro", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) == 0
    assert launched["tool_calling"].auto_parser() is not None


def test_a_serve_config_with_a_parser_but_no_auto_tool_choice_is_refused():
    replicas = pytest.importorskip("looped_spec.server.replicas")  # Ray Serve's arguments (nothing starts)
    with pytest.raises(
        ValueError, match="tool_calling: --tool-call-parser hermes: only with --enable-auto-tool-choice"
    ):
        replicas.parse_args({"tool_calling": {"tool_call_parser": "hermes"}})
    both = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    assert replicas.parse_args({"tool_calling": both}).tool_calling.auto_parser() is not None


def test_metrics_port_without_replicas_is_an_error_not_ray_serve(launched, capsys):
    err = usage_error(["serve", "tiny-ouro", "--metrics-port", "9100"], capsys)
    assert "--metrics-port 9100: only with --replicas or --max-replicas" in err
    assert launched == {}  # no Ray Serve started in its place, no engine
    assert main(["serve", "tiny-ouro", "--replicas", "2", "--metrics-port", "9100"]) == 0
    assert (launched["replica_args"].num_replicas, launched["replica_args"].metrics_port) == (2, 9100)


def test_serve_takes_the_model_as_model_flag_as_vllm_does(launched, capsys):
    assert main(["serve", "--model", "tiny-huginn", "--log-level", "warning"]) == 0
    assert (launched["model"], launched["name"]) == ("tiny-huginn", "tiny-huginn")
    assert main(["serve", "tiny-huginn", "--model", "tiny-huginn", "--log-level", "warning"]) == 0  # the same twice
    assert launched["model"] == "tiny-huginn"
    assert main(["serve", "--log-level", "warning"]) == 0
    assert launched["model"] == "tiny-ouro"  # neither: the default
    launched.clear()
    err = usage_error(["serve", "tiny-ouro", "--model", "tiny-huginn"], capsys)
    assert "--model tiny-huginn and the positional model tiny-ouro differ" in err
    assert launched == {}
    assert main(["serve", "--model", "tiny-huginn", "--replicas", "2"]) == 0
    assert launched["replica_args"].model == "tiny-huginn"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--model MODEL" in capsys.readouterr().out


@pytest.mark.parametrize("plain", ["off", "0,0"])
def test_compare_plain_with_plain_decoding_is_an_error(plain, launched, capsys):
    argv = ["generate", "--model", "tiny-ouro", "--prompt", "x", "--max-tokens", "2", "--compare-plain"]
    err = usage_error([*argv, "--speculation", plain], capsys)
    assert f"--compare-plain: times speculation against plain decoding, and --speculation {plain} is plain" in err
    assert launched == {}  # checked before the engine loads


@pytest.mark.parametrize("replicas", [[], ["--replicas", "2"]])
def test_an_empty_api_key_is_an_error_not_a_server_without_one(replicas, launched, capsys):
    """`--api-key "$KEY"` with KEY unset served /v1/* to anyone, the key silently dropped."""
    err = usage_error(["serve", "tiny-ouro", "--api-key", "", *replicas], capsys)
    assert "--api-key '': is empty; give the key, or leave --api-key out" in err
    assert launched == {}
    assert main(["serve", "tiny-ouro", "--api-key", "k", "--log-level", "warning", *replicas]) == 0
    assert (launched["replica_args"].api_key if replicas else launched["api_key"]) == "k"


@pytest.mark.parametrize("replicas", [[], ["--replicas", "2"]])
def test_an_empty_host_is_an_error_not_every_interface(replicas, launched, capsys):
    """uvicorn (asyncio's create_server) binds host "" to every interface: `--host "$HOST"` with HOST unset exposed
    the server that the default 127.0.0.1 keeps on this machine."""
    err = usage_error(["serve", "tiny-ouro", "--host", "", *replicas], capsys)
    assert "--host '': is empty; give an address" in err
    assert launched == {}


@pytest.mark.parametrize("replicas", [[], ["--replicas", "2"]])
def test_an_empty_served_model_name_is_an_error_not_the_folder_name(replicas, launched, capsys):
    """`--served-model-name "$NAME"` with NAME unset fell back to the folder's name, silently."""
    err = usage_error(["serve", "tiny-ouro", "--served-model-name", " ", *replicas], capsys)
    assert "--served-model-name ' ': is empty" in err
    assert launched == {}


@pytest.mark.parametrize("field", ["api_key", "served_model_name"])
def test_a_serve_config_with_a_blank_key_or_name_is_refused_naming_it(field):
    """The Serve config file's args (`api_key: "${KEY}"` with KEY unset) are checked as the flags are: a blank key
    would serve /v1/* with none."""
    from looped_spec.server.replicas import parse_args

    with pytest.raises(ValueError, match=f"{field}: is empty"):
        parse_args({"model": "tiny-ouro", field: ""})


@pytest.mark.parametrize("replicas", [[], ["--replicas", "2"]])
def test_a_model_that_does_not_exist_is_an_error_naming_model(replicas, monkeypatch, capsys, tmp_path):
    """With --replicas the loader's message named the path alone, where the single engine's names --model."""
    monkeypatch.setattr("looped_spec.server.replicas.run_replicas",
                        lambda args, host, port: pytest.fail("Ray Serve started"))  # fmt: skip
    missing = str(tmp_path / "no-such-model")
    err = usage_error(["serve", missing, *replicas], capsys)
    assert err.startswith(f"looped-spec: error: --model {missing}: not a checkpoint folder"), err


def test_replicas_refuse_what_the_model_cannot_run_before_ray_starts(monkeypatch, capsys):
    """A draft depth past the model's, a max_model_len past its positions: each replica would load the weights and
    fail (Ray retries it, then its traceback, ~40 s later); the driver checks them on the model's weightless
    description first, naming the flag as one engine does. A depth set by an adapter option counts."""
    monkeypatch.setattr("looped_spec.server.replicas.run_replicas",
                        lambda args, host, port: pytest.fail("Ray Serve started"))  # fmt: skip
    for argv, message in (
        (["tiny-ouro", "--speculation", "2,9"], "--speculation: d=9: must be in 1..3 (the model's full depth is D=4)"),
        (["tiny-ouro", "--max-model-len", "5000"], "--max-model-len 5000 must be in [2, 1024]"),
        (["tiny-huginn", "--adapter-option", "num_steps=4", "--speculation", "2,5"], "d=5: must be in 1..3"),
    ):
        err = usage_error(["serve", *argv, "--replicas", "2"], capsys)
        assert message in err, err


@pytest.mark.parametrize(
    ("given", "answer"),
    [
        (["--uvicorn-log-level", "debug"], "here --log-level (uvicorn's lines and looped-spec's own alike)"),
        (["--disable-uvicorn-access-log"], "here --log-level warning hides uvicorn's access lines"),
        (["--disable-log-requests"], "not needed: requests are not logged here"),
        (["--enable-log-requests"], "not offered: a request's parameters are not logged"),
        (["--disable-log-stats"], "not needed: no periodic stats lines are logged here; GET /metrics serves them"),
        (["--allowed-origins", '["*"]'], "not offered: the server sends no CORS headers"),
        (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"], "not offered: the server speaks plain HTTP"),
        (["--root-path", "/api"], "not offered: the routes are served from /"),
        (["--lora-modules", "a=/x"], "not offered: no LoRA adapters here"),
        (["--api-server-count", "2"], "one API server process here; --replicas N scales out with Ray Serve"),
    ],
)  # fmt: skip
def test_a_vllm_serve_flag_says_what_stands_for_it(given, answer, launched, capsys):
    """`vllm serve`'s own flags, not engine arguments (vllm/entrypoints/openai/cli_args.py): argparse's error line
    names the flag and what stands for it, nothing starts."""
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "tiny-ouro", *given])
    err = capsys.readouterr().err.splitlines()[-1]
    assert exit_.value.code == 2 and err.startswith(f"looped-spec serve: error: {given[0]}: vLLM's flag; {answer}")
    assert "unrecognized arguments" not in err and launched == {}
