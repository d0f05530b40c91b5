"""Issue 11 item 13: command-line mistakes are usage errors (exit 2, one line), never tracebacks."""

from __future__ import annotations

import shutil

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
