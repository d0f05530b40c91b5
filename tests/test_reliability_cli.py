"""Issue 11 item 13: command-line mistakes are usage errors (exit 2, one line), never tracebacks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from looped_spec.cli import main
from looped_spec.models import shipped_model_path


def one_line_usage_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("looped-spec: error:") and "\n" not in err and "Traceback" not in err
    return err


def no_measuring(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("tune measured before checking its arguments")

    monkeypatch.setattr("looped_spec.tuning.tuner.tune", fail)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_item13_cuda_device_on_a_cpu_build(capsys):
    err = one_line_usage_error(capsys, ["generate", "--prompt", "x", "--max-tokens", "2", "--device", "cuda"])
    assert "cuda" in err


def test_item13_trace_path_is_checked(tmp_path, capsys):
    (tmp_path / "file.txt").write_text("")
    for trace, named in ((tmp_path, "is a directory"), (tmp_path / "file.txt" / "trace.jsonl", "is a file")):
        err = one_line_usage_error(capsys, ["generate", "--prompt", "x", "--max-tokens", "2", "--trace", str(trace)])
        assert "--trace" in err and named in err


def test_item13_serve_checks_the_trace_path_before_loading_the_model(tmp_path, capsys, monkeypatch):
    """As generate does: serve said `[Errno 21] Is a directory: ...`, naming no flag, after loading the model."""

    def no_engine(*args, **kwargs):
        raise AssertionError("serve loaded the model before checking --trace")

    monkeypatch.setattr("looped_spec.LoopedSpecEngine", no_engine)
    (tmp_path / "file.txt").write_text("")
    for trace, named in ((tmp_path, "is a directory"), (tmp_path / "file.txt" / "trace.jsonl", "is a file")):
        err = one_line_usage_error(capsys, ["serve", "tiny-ouro", "--trace", str(trace)])
        assert "--trace" in err and named in err


def test_item13_corrupt_tokenizer(tmp_path, capsys):
    folder = tmp_path / "tiny-ouro"
    shutil.copytree(shipped_model_path("tiny-ouro"), folder)
    (folder / "tokenizer.json").chmod(0o644)
    (folder / "tokenizer.json").write_text("{ not json")
    err = one_line_usage_error(capsys, ["generate", "--model", str(folder), "--prompt", "x", "--max-tokens", "2"])
    assert "tokenizer.json" in err


def test_item13_tune_arguments_are_checked_before_measuring(tmp_path, capsys, monkeypatch):
    no_measuring(monkeypatch)
    (tmp_path / "file.txt").write_text("")
    base = ["tune", "--model", "tiny-ouro", "--quiet"]
    for out, named in ((tmp_path, "is a directory"), (tmp_path / "file.txt" / "p.json", "is a file")):
        err = one_line_usage_error(capsys, [*base, "--out", str(out)])
        assert "--out" in err and named in err
    err = one_line_usage_error(capsys, [*base, "--out", str(tmp_path / "p.json"), "--threads", "-1"])
    assert "--threads -1" in err


def test_tune_output_files_are_checked_before_measuring(tmp_path, capsys, monkeypatch):
    """The preset and the heatmap: named, distinct, in a format matplotlib writes, and in a folder that really
    takes a new file (os.access says yes to root on /proc), all before minutes of timing."""
    no_measuring(monkeypatch)
    base = ["tune", "--model", "tiny-ouro", "--quiet"]
    out = str(tmp_path / "p.json")
    for argv, named in [
        (["--out", ""], "--out '': is empty"),
        (["--out", out, "--heatmap", out], "is the --out file"),
        (["--out", str(tmp_path / "p.png"), "--heatmap"], "is the --out file"),  # the default: --out with .png
        (["--out", out, "--heatmap", str(tmp_path / "h.xyz")], "--heatmap"),
        (["--out", out, "--heatmap", str(tmp_path / "heat")], "--heatmap"),
        (["--out", out, "--hardware", ""], "--hardware '': is empty"),
    ]:
        err = one_line_usage_error(capsys, [*base, *argv])
        assert named in err, (argv, err)
    assert ".png" in one_line_usage_error(capsys, [*base, "--out", out, "--heatmap", str(tmp_path / "h.xyz")])
    if Path("/proc").is_dir():
        for argv in (["--out", "/proc/p.json"], ["--out", out, "--heatmap", "/proc/h.png"]):
            err = one_line_usage_error(capsys, [*base, *argv])
            assert argv[-2] in err and "cannot write in /proc" in err
    assert not list(tmp_path.iterdir())


def test_tune_writing_errors_name_the_flag_and_leave_no_partial_file(tmp_path):
    from looped_spec.cli.common import UsageError
    from looped_spec.cli.tune import write_output

    def refused(path):
        path.write_text("half")
        raise PermissionError(13, "Permission denied")

    target = tmp_path / "presets" / "p.json"
    with pytest.raises(UsageError, match=rf"--out {target}: cannot write it: Permission denied"):
        write_output(target, "--out", refused)
    assert list((tmp_path / "presets").iterdir()) == []
    write_output(target, "--out", lambda path: path.write_text("{}"))
    assert target.read_text() == "{}" and len(list(target.parent.iterdir())) == 1
    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    assert target.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777  # not mkstemp's private 0600


def test_tune_ctrl_c_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("looped_spec.tuning.tuner.tune", interrupted)
    out = tmp_path / "p.json"
    try:
        rc = main(["tune", "--model", "tiny-ouro", "--quiet", "--out", str(out)])
    except KeyboardInterrupt:  # caught here, or it would end the test session
        pytest.fail("a Ctrl-C during tune escaped as a KeyboardInterrupt")
    assert rc == 130
    err = capsys.readouterr().err.strip()
    assert err == "looped-spec: interrupted; no preset written"
    assert not list(tmp_path.iterdir())


def test_tune_threads_default_to_one_like_generate_and_serve():
    from looped_spec.cli import build_parser

    parser = build_parser()
    for argv in (["tune", "--model", "m", "--out", "p.json"], ["generate", "--prompt", "x"], ["serve"]):
        assert parser.parse_args(argv).threads == 1, argv


def test_tune_cost_from_refuses_what_the_profile_was_not_timed_with(tmp_path, capsys, monkeypatch):
    """The shipped tiny-ouro preset was timed on 'cpu-2core' in float32 with the tune prompts: another hardware
    tag or dtype would mislabel its profile, and --seed seeds nothing a re-derivation on text prompts does."""
    no_measuring(monkeypatch)
    base = ["tune", "--model", "tiny-ouro", "--quiet", "--out", str(tmp_path / "p.json"), "--cost-from", "tiny-ouro"]
    err = one_line_usage_error(capsys, [*base, "--hardware", "nvidia-h100"])
    assert "--hardware nvidia-h100" in err and "'cpu-2core'" in err
    err = one_line_usage_error(capsys, [*base, "--dtype", "bfloat16"])
    assert "--dtype bfloat16" in err and "float32" in err
    err = one_line_usage_error(capsys, [*base, "--seed", "3"])
    assert "--seed" in err and "--cost-from" in err and "--prompts tune" in err
