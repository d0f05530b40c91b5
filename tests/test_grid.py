"""The one parser of batch sizes, the (K, d) grid and workload phases (tuner and benchmarks alike)."""

from __future__ import annotations

import pytest

from looped_spec.tuning.grid import (
    GridError,
    Phase,
    auto_grid,
    full_grid,
    parse_batch_sizes,
    parse_grid,
    parse_int_list,
    parse_phases,
    parse_prompt_source,
)
from looped_spec.tuning.inputs import TunerError


def test_auto_is_the_tuners_grid_and_full_is_larger():
    assert parse_grid("auto", 4) == auto_grid(4) == [(k, d) for k in range(1, 6) for d in (1, 2, 3)]
    assert parse_grid(" AUTO ", 32) == [(k, d) for k in range(1, 6) for d in (1, 2, 8, 16, 31)]
    assert parse_grid("auto", 8) == [(k, d) for k in range(1, 6) for d in (1, 2, 4, 7)]
    assert parse_grid("auto", 2) == [(k, 1) for k in range(1, 6)]
    assert parse_grid("full", 4) == full_grid(4) == [(k, d) for k in range(1, 9) for d in (1, 2, 3)]
    assert len(parse_grid("full", 8)) == 8 * 7 and set(auto_grid(8)) < set(full_grid(8))


def test_explicit_cells_keep_their_order_and_drop_repeats():
    assert parse_grid("2,1; 1,2;2,1", 4) == [(2, 1), (1, 2)]
    assert parse_grid([(3, 1), (3, 1), (1, 3)], 4) == [(3, 1), (1, 3)]
    assert parse_grid("64,1", 2) == [(64, 1)]


@pytest.mark.parametrize(
    "spec, depth, words",
    [
        ("1,4", 4, "--grid entry '1,4': d=4 must be in 1..3"),
        ("0,1", 4, "--grid entry '0,1': K=0"),
        ("65,1", 4, "K=65 must be in 1..64"),
        ("1;2", 4, "--grid entry '1': expected 'K,d'"),
        ("a,b", 4, "--grid entry 'a,b'"),
        ("1,1;2,x", 4, "--grid entry '2,x'"),
        ("", 4, "--grid '': no entries"),
        ("none", 4, "--grid entry 'none'"),  # only where the caller allows no cells
        ("auto", 1, "--grid auto: the model has full depth D=1"),
        ("full", 1, "--grid full: the model has full depth D=1"),
    ],
)
def test_grid_errors_name_the_flag_and_the_entry(spec, depth, words):
    with pytest.raises(GridError, match=words.replace("(", r"\(")):
        parse_grid(spec, depth)


def test_grid_flag_name_and_no_cells_where_allowed():
    assert parse_grid("none", 4, allow_none=True) == parse_grid("", 4, allow_none=True) == []
    with pytest.raises(GridError, match="--plans entry '1,9'"):
        parse_grid("1,1;1,9", 4, flag="--plans")
    with pytest.raises(TunerError):  # a GridError is a TunerError (the tuner's callers catch those) ...
        parse_grid("x", 4)
    with pytest.raises(ValueError):  # ... and a ValueError (the CLI and the benchmarks exit with status 2)
        parse_grid("x", 4)


def test_batch_sizes_and_integer_lists():
    assert parse_batch_sizes("8,1,8") == [1, 8]
    assert parse_batch_sizes([32, 1]) == [1, 32]
    assert parse_int_list("3, 1,3", "--exit-at-steps") == [3, 1, 3]  # order and repeats kept
    for bad, words in [("0,2", "--batch-sizes entry '0': must be >= 1"), ("1,x", "--batch-sizes entry 'x'"),
                       ("", "--batch-sizes '': need at least one"), (" , ", "need at least one")]:  # fmt: skip
        with pytest.raises(GridError, match=words):
            parse_batch_sizes(bad)
    with pytest.raises(GridError, match="--exit-at-steps entry '-1'"):
        parse_int_list("2,-1", "--exit-at-steps")


def test_workload_phases_take_an_optional_group():
    assert parse_phases("1,8,32,8,1", "eval") == [Phase(b, "eval") for b in (1, 8, 32, 8, 1)]
    phases = parse_phases("8:eval, 8:code,32:PROSE ,8", "random")
    assert phases == [Phase(8, "eval"), Phase(8, "code"), Phase(32, "prose"), Phase(8, "random")]
    assert [p.batch for p in phases] == [8, 8, 32, 8] and phases[1].group == "code"
    assert parse_phases("2 : tune", "eval") == [Phase(2, "tune")]


def test_a_prompt_source_is_a_group_or_a_prompt_file_of_ones_own():
    """--prompts and a phase's GROUP take a group (any case) or a .txt / .jsonl file, whose path is kept as given (it
    is read, and checked, when loaded); anything else names the flag and the entry."""
    assert parse_prompt_source(" Code ") == "code"
    assert parse_prompt_source("data/My-Text.jsonl") == "data/My-Text.jsonl"
    assert parse_phases("8:eval,8:/tmp/Mine.txt,1", "x.jsonl") == [
        Phase(8, "eval"), Phase(8, "/tmp/Mine.txt"), Phase(1, "x.jsonl")
    ]  # fmt: skip
    with pytest.raises(GridError, match=r"--prompts: unknown prompt group 'novel'; use one of eval, .*random, or a "
                       r"\.txt or \.jsonl prompt file"):  # fmt: skip
        parse_prompt_source("novel")
    with pytest.raises(GridError, match=r"--prompts: unknown prompt group 'mine\.json'"):
        parse_prompt_source("mine.json")
    with pytest.raises(GridError, match=r"--workload-phases entry '8:mine\.csv': unknown prompt group 'mine\.csv'"):
        parse_phases("8:mine.csv", "eval")


@pytest.mark.parametrize(
    "spec, words",
    [
        ("8:novel", "--workload-phases entry '8:novel': unknown prompt group 'novel'; use one of eval, code, prose"),
        ("8:", "--workload-phases entry '8:': expected B or B:GROUP"),
        ("x:code", "--workload-phases entry 'x:code': expected B or B:GROUP with an integer"),
        ("8,0:code", "--workload-phases entry '0:code': batch size 0 must be >= 1"),
        ("8:code:1", "--workload-phases entry '8:code:1': unknown prompt group 'code:1'"),
        ("", "--workload-phases '': need at least one phase"),
    ],
)
def test_workload_phase_errors_name_the_flag_and_the_entry(spec, words):
    with pytest.raises(GridError, match=words):
        parse_phases(spec, "eval")
