"""Preset schema, validation messages, shipped files and preset lookup."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
from conftest import FAMILIES, fixture_dir, load

from looped_spec.presets import AdaptiveSpecConfig, PresetError, find_preset, load_preset, preset_for, read_preset_file
from looped_spec.presets.lookup import generic_preset, list_presets, match_preset_name, preset_dir
from looped_spec.tuning.derive import ideal_cost

SHIPPED_DEPTHS = {
    "ouro-1.4b": 4,
    "ouro-2.6b": 4,
    "huginn-0125": 32,
    "nanbeige4.2-3b": 2,
    "tiny-ouro": 4,
    "tiny-huginn": 8,
    "tiny-nanbeige": 2,
}

BASE = {
    "model": "test",
    "full_depth": 3,
    "cost": ideal_cost(64),
    "buckets": [
        {"min_batch": 1, "max_batch": 4, "candidates": [[1, 2], [2, 1]], "theta_up": 0.8, "theta_down": 0.4},
        {"min_batch": 5, "max_batch": None, "candidates": [[0, 0], [1, 1]], "theta_up": 0.8, "theta_down": 0.4},
    ],
    "provenance": "unit test",
}


def bad(edit) -> str:
    """Apply `edit` to a copy of BASE and return the PresetError message."""
    data = copy.deepcopy(BASE)
    edit(data)
    with pytest.raises(PresetError) as err:
        AdaptiveSpecConfig.parse(data)
    return str(err.value)


def test_base_is_valid_and_compact_candidates_parse():
    cfg = AdaptiveSpecConfig.parse(BASE)
    assert [(c.k, c.d) for c in cfg.buckets[0].candidates] == [(1, 2), (2, 1)]
    assert cfg.for_depth(3) == (cfg, None)


@pytest.mark.parametrize("name", sorted(SHIPPED_DEPTHS))
def test_every_shipped_preset_loads_for_its_depth(name):
    depth = SHIPPED_DEPTHS[name]
    cfg = read_preset_file(preset_dir() / f"{name}.json")
    assert cfg.for_depth(depth) == (cfg, None)
    assert cfg.full_depth == depth
    assert cfg.provenance
    if name.startswith("tiny-"):  # the shipped trained models' presets were measured by the tuner
        assert cfg.provenance["tool"] == "looped_spec.tuning.tuner" and cfg.provenance["cost"]
        assert cfg.acceptance is not None and cfg.acceptance.positions > 0 and cfg.cost is not None
    loaded = load_preset(name, depth)
    assert loaded.model == name


def test_the_derived_presets_are_what_the_rules_give_and_the_check_names_one_that_is_not(tmp_path, monkeypatch, capsys):
    """scripts/derive_presets.py --check: the presets of models that cannot run here (derived from assumptions with
    the tuner's rules) are the files the rules give now, so a change of the rules cannot leave them stale unseen; and
    the check fails, naming the file, when one differs."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import derive_presets

    monkeypatch.setattr("sys.argv", ["derive_presets.py", "--check"])
    assert derive_presets.main() == 0
    assert capsys.readouterr().out.strip() == "differ: none"
    for name in derive_presets.DERIVED:
        (tmp_path / f"{name}.json").write_text((derive_presets.PRESETS / f"{name}.json").read_text())
    stale = tmp_path / "ouro-1.4b.json"
    data = json.loads(stale.read_text())
    data["buckets"][0]["beta"] = 0.9  # what a hand edit, or the rules moving on, leaves
    stale.write_text(json.dumps(data, indent=2))
    monkeypatch.setattr(derive_presets, "PRESETS", tmp_path)
    assert derive_presets.main() == 1
    assert capsys.readouterr().out.strip() == "differ: ouro-1.4b"


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_checkpoints_carry_their_own_preset(family):
    """The random-weight fixtures' presets are preset.json in each fixture folder (tuned on random prompts)."""
    from looped_spec import LoopedSpecEngine

    folder = fixture_dir(family)
    path, reason = find_preset(folder.name, folder)
    assert path == folder / "preset.json" and reason == "preset.json in the checkpoint folder"
    assert not (preset_dir() / f"{folder.name}.json").exists()
    engine = LoopedSpecEngine(load(family), speculation="adaptive")
    assert engine.controller.config.model == folder.name
    assert engine.controller.config.provenance["prompts"]["source"] == "random"


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 8, 32, 64])
def test_generic_default_works_for_any_depth(depth):
    cfg = generic_preset(depth)
    assert cfg.full_depth == depth
    for bucket in cfg.buckets:
        pairs = [(c.k, c.d) for c in bucket.candidates]
        assert len(pairs) == len(set(pairs))  # duplicates from clamping are merged
        assert all(c.k == 0 or 1 <= c.d < depth for c in bucket.candidates)
        assert 0 <= bucket.initial_index < len(pairs)
    if depth == 2:
        assert {c.d for b in cfg.buckets for c in b.candidates if c.k} == {1}
    if depth == 1:
        assert all(c.k == 0 for b in cfg.buckets for c in b.candidates)


def test_another_depth_rescales_candidates_and_interpolates_acceptance():
    data = copy.deepcopy(BASE)
    data.update(full_depth=4, acceptance={"alpha": [0.6, 0.8, 0.9, 1.0], "rho": [0.2, 0.1, 0.0, 0.0]})
    data["buckets"][0]["candidates"] = [[1, 3], [1, 2], [2, 1]]
    data["buckets"][0]["initial_index"] = 1
    cfg = AdaptiveSpecConfig.parse(data)
    at8, note = cfg.for_depth(8)
    assert note is not None and "depth 4" in note and "8" in note
    assert at8.full_depth == 8
    assert [(c.k, c.d) for c in at8.buckets[0].candidates] == [(1, 6), (1, 4), (2, 2)]
    assert at8.buckets[0].initial_index == 1  # nothing merged: the initial candidate keeps its place
    # depth 2 of 8 is depth 1 of 4 (same relative depth); depth 1 of 8 halfway to depth 0 (agreement 0)
    assert at8.acceptance.alpha == pytest.approx([0.3, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0])
    assert at8.acceptance.rho[1] == pytest.approx(0.2) and at8.acceptance.rho[3] == pytest.approx(0.1)
    at2, _ = cfg.for_depth(2)  # (1,3) and (1,2) both clamp to (1,1): merged, initial follows
    assert [(c.k, c.d) for c in at2.buckets[0].candidates] == [(1, 1), (2, 1)]
    assert at2.buckets[0].initial_index == 0
    assert at2.acceptance.alpha == pytest.approx([0.8, 1.0])


def test_for_depth_starts_at_the_candidate_the_initial_one_merged_into_and_at_depth_one_at_plain():
    """A candidate that becomes an earlier one of its bucket (not the last kept) is merged into it, and a bucket
    that started at it starts there; at depth 1 a bucket without a plain candidate is plain alone."""
    data = copy.deepcopy(BASE)
    data["full_depth"] = 4
    data["buckets"][0].update(candidates=[[1, 3], [2, 1], [1, 2]], initial_index=2)
    cfg = AdaptiveSpecConfig.parse(data)
    bucket = cfg.for_depth(2)[0].buckets[0]
    assert [(c.k, c.d) for c in bucket.candidates] == [(1, 1), (2, 1)]
    assert bucket.initial_index == 0
    at1 = cfg.for_depth(1)[0]
    assert [[(c.k, c.d) for c in b.candidates] for b in at1.buckets] == [[(0, 0)], [(0, 0)]]
    assert [b.initial_index for b in at1.buckets] == [0, 0]


def test_the_note_of_a_preset_fitted_to_another_depth_says_only_what_changed():
    """The generic default.json holds no acceptance: its note must not say acceptance was interpolated."""
    at6, note = AdaptiveSpecConfig.parse(BASE).for_depth(6)
    assert at6.acceptance is None
    assert note == "measured at depth 3, the model runs 6: candidates' d rescaled by 6/3"
    data = copy.deepcopy(BASE)
    data["acceptance"] = {"alpha": [0.6, 0.8, 1.0], "rho": [0.0, 0.0, 0.0]}
    _, note = AdaptiveSpecConfig.parse(data).for_depth(6)
    assert note.endswith("rescaled by 6/3, acceptance interpolated at the same relative depth")


@pytest.mark.parametrize(
    ("model_name", "expected"),
    [
        ("Ouro-1.4B", "ouro-1.4b"),
        ("/models/ByteDance/Ouro-2.6B/", "ouro-2.6b"),
        ("ByteDance/Ouro-1.4B-Thinking", "ouro-1.4b"),
        ("tiny-ouro", "tiny-ouro"),
        ("tests/fixtures/huginn-tiny", None),  # a fixture's preset is its folder's preset.json
        ("Huginn-0125", "huginn-0125"),
        ("Nanbeige4.2-3B", "nanbeige4.2-3b"),
        ("some-other-model", None),
        ("tiny-ouro.v2", "tiny-ouro"),  # a preset name followed by ".", "-" or "_" is a prefix match ...
        ("tiny-ouroboros", None),  # ... followed by anything else it is another model's name
        ("default", None),  # the generic preset is no model's
    ],
)
def test_model_name_matching(model_name, expected):
    assert match_preset_name(model_name) == expected


def test_the_longest_preset_name_prefixing_a_model_name_wins(monkeypatch):
    """Of shipped presets "ouro" and "ouro-1.4b", "Ouro-1.4B-Thinking" is the latter's (the longest prefix)."""
    monkeypatch.setattr("looped_spec.presets.lookup.list_presets", lambda: ["default", "ouro", "ouro-1.4b"])
    assert match_preset_name("Ouro-1.4B-Thinking") == "ouro-1.4b"
    assert match_preset_name("Ouro-7B") == "ouro"


def test_unknown_model_gets_generic_default():
    assert load_preset("my-looped-model", 6).model == generic_preset(6).model


def snapshot(root: Path, repo: str, config: dict | None = None) -> Path:
    """A checkpoint folder laid out like the Hugging Face cache: models--ORG--NAME/snapshots/<hash>."""
    folder = root / f"models--{repo.replace('/', '--')}" / "snapshots" / "0123abcd"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or {}))
    return folder


def test_only_a_cache_snapshot_folder_takes_its_repository_name(tmp_path: Path):
    """A folder two levels under models--ORG--NAME but not in its snapshots/ (say blobs/) is not a cache snapshot:
    its repository's name does not pick the preset."""
    folder = tmp_path / "models--acme--tiny-ouro" / "blobs" / "0123abcd"
    folder.mkdir(parents=True)
    path, reason = find_preset(folder.name, folder)
    assert path == preset_dir() / "default.json", reason


def test_preset_is_chosen_by_each_name_a_checkpoint_goes_by(tmp_path: Path, caplog):
    hub = snapshot(tmp_path, "ByteDance/Ouro-1.4B")
    path, reason = find_preset(hub.name, hub)  # the folder name is a hash
    assert path == preset_dir() / "ouro-1.4b.json"
    assert reason == "Hugging Face cache repository 'ByteDance/Ouro-1.4B' matches the shipped preset 'ouro-1.4b'"
    folder = tmp_path / "checkpoint-1000"
    path, reason = find_preset(folder.name, folder, {"_name_or_path": "ByteDance/Ouro-2.6B", "model_type": "ouro"})
    assert path == preset_dir() / "ouro-2.6b.json"
    assert reason == "config.json _name_or_path 'ByteDance/Ouro-2.6B' matches the shipped preset 'ouro-2.6b'"
    path, reason = find_preset("Huginn-0125", None, {"_name_or_path": "ByteDance/Ouro-2.6B"})  # the name first
    assert path.name == "huginn-0125.json"
    path, reason = find_preset(folder.name, folder, {"model_type": "ouro"})
    assert path == preset_dir() / "default.json"
    assert reason == "no shipped preset matches model name 'checkpoint-1000': the family-generic default"
    with caplog.at_level(logging.INFO, logger="looped_spec.presets.lookup"):
        assert load_preset(hub.name, 4, folder=hub).model == "ouro-1.4b"
    assert caplog.messages == [
        f"adaptive preset for 0123abcd: {preset_dir() / 'ouro-1.4b.json'} (Hugging Face cache repository "
        "'ByteDance/Ouro-1.4B' matches the shipped preset 'ouro-1.4b')"
    ]


def test_a_name_matching_the_preset_of_another_family_gets_the_generic_one(tmp_path: Path):
    """A folder named after a shipped model but holding another family (a new one fine-tuned from tiny-ouro's folder,
    say) must not be priced with that model's acceptance and costs: each shipped preset records its family."""
    folder = tmp_path / "tiny-ouro-gated"
    path, reason = find_preset(folder.name, folder, {"model_type": "gated_loop"})
    assert path == preset_dir() / "default.json"
    assert reason == (
        "model name 'tiny-ouro-gated' matches 'tiny-ouro', a preset for model_type 'ouro', not 'gated_loop': the "
        "family-generic default"
    )
    assert find_preset(folder.name, folder, {"model_type": "ouro"})[0] == preset_dir() / "tiny-ouro.json"
    assert find_preset("Ouro-1.4B-Thinking", None, {"model_type": "ouro"})[0] == preset_dir() / "ouro-1.4b.json"
    shipped = {name: read_preset_file(preset_dir() / f"{name}.json").model_type for name in list_presets()}
    assert shipped == {
        "default": None, "huginn-0125": "huginn_raven", "nanbeige4.2-3b": "nanbeige", "ouro-1.4b": "ouro",
        "ouro-2.6b": "ouro", "tiny-huginn": "huginn_raven", "tiny-nanbeige": "nanbeige", "tiny-ouro": "ouro",
    }  # fmt: skip


def test_preset_json_in_the_checkpoint_folder_wins_over_names(tmp_path: Path):
    folder = snapshot(tmp_path, "ByteDance/Ouro-1.4B", {"_name_or_path": "ByteDance/Ouro-1.4B"})
    (folder / "preset.json").write_text(json.dumps(BASE))
    assert load_preset("Ouro-1.4B", 4, folder=folder).model == "test"
    assert load_preset("Ouro-1.4B", 4, "ouro-2.6b", folder=folder).model == "ouro-2.6b"  # preset= wins over both


def test_preset_argument_wins(tmp_path: Path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(BASE))
    assert load_preset("Ouro-1.4B", 4, path).model == "test"
    assert load_preset("Ouro-1.4B", 4, str(path)).model == "test"
    assert load_preset("Ouro-1.4B", 4, "tiny-ouro").model == "tiny-ouro"
    cfg = AdaptiveSpecConfig.parse(BASE)
    assert load_preset("Ouro-1.4B", 3, cfg) is cfg  # at its own depth, as it is
    assert load_preset("Ouro-1.4B", 4, cfg).full_depth == 4  # at another, fitted to it


def test_errors_name_the_file(tmp_path: Path):
    with pytest.raises(PresetError, match="nope.json': no such preset"):
        load_preset("x", 4, tmp_path / "nope.json")
    with pytest.raises(PresetError, match="a directory, not a preset file"):
        load_preset("x", 4, tmp_path)
    path = tmp_path / "broken.json"
    data = copy.deepcopy(BASE)
    data["buckets"][0]["beta"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(PresetError, match=r"broken\.json: buckets\[0\]\.beta: Input should be greater than 0"):
        load_preset("x", 4, path)
    data = copy.deepcopy(BASE)
    data["bukets"] = data.pop("buckets")
    data["disable"] = {"treshold": 0.1}
    path.write_text(json.dumps(data))
    with pytest.raises(PresetError) as error:
        read_preset_file(path)
    message = str(error.value)
    assert "broken.json: bukets: Extra inputs are not permitted (did you mean 'buckets'?)" in message
    assert "broken.json: disable.treshold: Extra inputs are not permitted (did you mean 'threshold'?)" in message
    path.write_text("{not json")
    with pytest.raises(PresetError, match="broken.json: invalid JSON"):
        read_preset_file(path)


def test_a_preset_file_that_is_not_utf8_text_is_an_error_naming_it(tmp_path: Path):
    """It was a bare UnicodeDecodeError ('utf-8' codec can't decode byte 0xff ...), naming neither the file
    nor the option, out of the engine and `generate --preset` alike."""
    path = tmp_path / "utf16.json"
    path.write_text(json.dumps(BASE), encoding="utf-16")
    with pytest.raises(PresetError, match=r"utf16\.json: not UTF-8 text .* at byte 0\); a preset file is JSON"):
        load_preset("x", 3, path)


# ---------------------------------------------------------------- one test per validation rule
def test_rule_overlapping_ranges():
    msg = bad(lambda d: d["buckets"][1].update(min_batch=3))
    assert "buckets[1]: range 3..inf overlaps buckets[0] (1..4)" in msg


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["buckets"][0].update(candidates=[[65, 1]]),
            "candidates[0].k: Input should be less than or equal to 64",
        ),
        (
            lambda d: d["buckets"][0].update(candidates=[[1, 2], [2, 1], [1, 2]]),
            "candidates[2]: duplicate of candidates[0]",
        ),
        (
            lambda d: d.update(acceptance={"alpha": [0.5, 0.8, 1.0], "rho": [0.0, 0.0]}),
            "alpha has 3 depths but rho has 2",
        ),
        (lambda d: d["cost"].update(positions=[1, 4, 4, 64, 256, 1024]), "must be non-empty and strictly increasing"),
        (lambda d: d["buckets"][1].update(min_batch=6), "min_batch=6 leaves a gap after buckets[0] (max_batch=4)"),
    ],
    ids=["k-above-64", "duplicate-candidate", "rho-length", "duplicate-width", "gap-of-one"],
)
def test_rule_bounds(edit, message):
    """Each at its bound: a draft of 65 tokens, a candidate listed twice, persistence for fewer depths than the
    agreement, a pass width listed twice, a gap of one batch size."""
    assert message in bad(edit)


def test_rule_gap():
    msg = bad(lambda d: d["buckets"][1].update(min_batch=7))
    assert "buckets[1]: min_batch=7 leaves a gap after buckets[0] (max_batch=4): batch sizes 5..6 uncovered" in msg


def test_rule_first_bucket_starts_at_one_and_last_is_unbounded():
    assert "buckets[0]: min_batch=2 must be 1" in bad(lambda d: d["buckets"][0].update(min_batch=2))
    assert "buckets[1]: max_batch=64 must be null" in bad(lambda d: d["buckets"][1].update(max_batch=64))
    assert "buckets[0]: max_batch=null (unbounded) is only allowed on the last bucket" in bad(
        lambda d: d["buckets"][0].update(max_batch=None)
    )


def test_rule_empty_candidates():
    assert "buckets[1].candidates: must not be empty" in bad(lambda d: d["buckets"][1].update(candidates=[]))


def test_rule_d_at_least_full_depth():
    assert "buckets[1].candidates[2]: d=3 must be < full depth 3" in bad(
        lambda d: d["buckets"][1].update(candidates=[[0, 0], [1, 1], [2, 3]])
    )


def test_rule_full_depth_and_cost_required():
    assert "full_depth: Field required" in bad(lambda d: d.pop("full_depth"))
    assert "cost: Field required" in bad(lambda d: d.pop("cost"))
    assert "cost.pass_seconds: 6 pass widths need 6 entries, got 2" in bad(
        lambda d: d["cost"].update(pass_seconds=[1e-3, 2e-3])
    ) or "cost: pass_seconds: 6 pass widths need 6 entries, got 2" in bad(
        lambda d: d["cost"].update(pass_seconds=[1e-3, 2e-3])
    )


def test_rule_acceptance_has_one_entry_per_depth():
    acceptance = {"alpha": [0.5, 0.7, 0.9, 1.0], "rho": [0.0] * 4}
    assert "acceptance.alpha: 4 depths, but full_depth is 3" in bad(lambda d: d.update(acceptance=acceptance))


def test_rule_costs_are_finite_and_not_all_zero():
    assert "cost.request_seconds: Input should be a finite number" in bad(
        lambda d: d["cost"].update(request_seconds=float("inf"))
    )

    def zero(d):
        for key, value in d["cost"].items():
            if key != "positions":
                d["cost"][key] = [0.0] * len(value) if isinstance(value, (list, tuple)) else 0.0

    assert "cost: every term of a plain round's cost is zero" in bad(zero)

    def only_speculation_costs(d):  # the message named every cost zero where one was not
        zero(d)
        d["cost"]["speculative_seconds"] = [1e-4, 0.0, 0.0]

    assert "(speculative_seconds, which only speculative rounds add, does not count)" in bad(only_speculation_costs)


def test_rule_types_are_strict_but_lists_may_be_tuples():
    assert "full_depth: Input should be a valid integer (got '3')" in bad(lambda d: d.update(full_depth="3"))
    assert "full_depth: Input should be a valid integer (got True)" in bad(lambda d: d.update(full_depth=True))
    assert "cost.request_seconds: Input should be a valid number" in bad(
        lambda d: d["cost"].update(request_seconds="0.001")
    )
    data = copy.deepcopy(BASE)
    data["cost"]["positions"] = tuple(data["cost"]["positions"])
    assert AdaptiveSpecConfig.parse(data).cost.positions == list(BASE["cost"]["positions"])


def test_a_preset_of_another_model_asked_for_is_used_with_a_warning(caplog, tmp_path: Path):
    snapshot = tmp_path / "models--acme--tiny-ouro" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="looped_spec.presets.lookup"):
        assert load_preset("tiny-ouro", 4, "tiny-ouro").model == "tiny-ouro"
        load_preset("tiny-ouro", 4, "default")  # the family-generic default is for any model
        load_preset("0123abcd", 4, "tiny-ouro", folder=snapshot)  # a cache snapshot goes by its repository's name
        assert not caplog.records
        assert load_preset("tiny-ouro", 4, "tiny-huginn").model == "tiny-huginn"
    assert "was tuned for model 'tiny-huginn', not 'tiny-ouro'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="looped_spec.presets.lookup"):
        load_preset("tiny-ouro", 4, "tiny-huginn", config={"model_type": "ouro"})
    assert "of another family (model_type 'huginn_raven', not 'ouro')" in caplog.text


def test_rule_d_below_one_with_k():
    assert "buckets[0].candidates[1]: d=0 must be >= 1 when k=2" in bad(
        lambda d: d["buckets"][0].update(candidates=[[1, 2], [2, 0]])
    )


def test_rule_plain_only_first():
    assert "buckets[0].candidates[1]: k=0 (plain decoding) is only allowed as the first candidate" in bad(
        lambda d: d["buckets"][0].update(candidates=[[1, 2], [0, 0]])
    )


def test_rule_plain_takes_no_thresholds_or_prior():
    """Plain rounds draft nothing, so the EMA policy's thresholds and prior on a k=0 candidate would do nothing."""
    msg = bad(lambda d: d["buckets"][0].update(candidates=[{"k": 0, "theta_up": 0.5, "prior": 0.3}, [2, 1]]))
    assert "buckets[0].candidates[0]: theta_up, prior on k=0 (plain decoding) would do nothing" in msg


def test_rule_theta_down_above_theta_up():
    assert "buckets[0]: theta_down=0.9 must be <= theta_up=0.8" in bad(lambda d: d["buckets"][0].update(theta_down=0.9))
    msg = bad(lambda d: d["buckets"][0].update(candidates=[{"k": 1, "d": 2, "theta_down": 0.85}, [2, 1]]))
    assert "buckets[0].candidates[0]: theta_down=0.85 must be <= theta_up=0.8" in msg


def test_rule_theta_missing():
    msg = bad(lambda d: d["buckets"][0].pop("theta_up"))
    assert "buckets[0].candidates[0]: theta_up missing" in msg


def test_rule_beta_zero():
    assert "buckets[0].beta: Input should be greater than 0 (got 0)" in bad(lambda d: d["buckets"][0].update(beta=0))


def test_rule_beta_above_one():
    assert "buckets[1].beta: Input should be less than or equal to 1 (got 1.5)" in bad(
        lambda d: d["buckets"][1].update(beta=1.5)
    )


def test_rule_unknown_key():
    assert "buckets[0].bogus: Extra inputs are not permitted" in bad(lambda d: d["buckets"][0].update(bogus=1))
    assert "disable.probe_bse: Extra inputs are not permitted" in bad(lambda d: d.update(disable={"probe_bse": 3}))
    # fields of older presets that nothing reads any more are errors, not shrugs
    assert "depth_rule: Extra inputs are not permitted" in bad(lambda d: d.update(depth_rule="scale"))
    assert "disable.use_timing: Extra inputs are not permitted" in bad(lambda d: d.update(disable={"use_timing": True}))


def test_rule_initial_index_out_of_range():
    assert "buckets[0].initial_index: 2 out of range for 2 candidates (0..1)" in bad(
        lambda d: d["buckets"][0].update(initial_index=2)
    )


def test_rule_probe_cap_below_base():
    assert "disable: probe_cap=4 must be >= probe_base=8" in bad(
        lambda d: d.update(disable={"probe_base": 8, "probe_cap": 4})
    )


def test_probe_evidence_below_one_names_the_field():
    assert "disable.probe_evidence" in bad(lambda d: d.update(disable={"probe_evidence": 0}))


def test_all_errors_reported_at_once():
    def edit(d):
        d["buckets"][0]["initial_index"] = 5
        d["buckets"][1]["min_batch"] = 9

    msg = bad(edit)
    assert "initial_index" in msg and "gap" in msg


@pytest.mark.parametrize("family", ["ouro", "huginn", "nanbeige"])
def test_preset_for_an_adapter_is_the_one_its_engine_runs(family):
    """The benchmarks' replays price with `preset_for(adapter)`: the preset the engine finds (the fixture's own file
    in its folder, not the family's generic one its name alone would give)."""
    from conftest import load, make_engine

    adapter = load(family)
    engine = make_engine(family, speculation="adaptive")
    found = preset_for(adapter)
    assert found == engine.controller.config
    assert found.model == f"{family}-tiny" != load_preset(adapter.name, adapter.full_depth).model


def test_a_preset_timed_at_another_thread_count_says_so_once(caplog, monkeypatch):
    """A CPU preset records the torch threads its profile was timed at; an adaptive engine on a CPU running at another
    count is told, once per preset and count (its plans' relative prices are another machine state's); a fixed plan,
    which prices nothing, is not."""
    import torch

    import looped_spec.presets.lookup as lookup
    from looped_spec import LoopedSpecEngine, load_adapter

    monkeypatch.setattr(lookup, "_told_threads", set())
    adapter = load_adapter("tiny-ouro")
    timed = preset_for(adapter).provenance["machine"]["torch_threads"]
    with caplog.at_level(logging.WARNING, logger="looped_spec.presets.lookup"):
        monkeypatch.setattr(torch, "get_num_threads", lambda: timed)
        LoopedSpecEngine(adapter, speculation="adaptive")
        assert not caplog.records
        monkeypatch.setattr(torch, "get_num_threads", lambda: timed + 3)
        LoopedSpecEngine(adapter, speculation="2,1")
        assert not caplog.records
        LoopedSpecEngine(adapter, speculation="adaptive")
        LoopedSpecEngine(adapter, speculation="adaptive")
        told = [r.getMessage() for r in caplog.records]
        assert len(told) == 1 and f"timed at {timed} torch thread(s) and this process runs {timed + 3}" in told[0]
        assert f"looped-spec tune --threads {timed + 3}" in told[0]
    lookup.warn_if_timed_at_other_threads(preset_for(adapter).model_copy(update={"provenance": "hand-written"}), 7)
    assert len(caplog.records) == 1  # no recorded thread count: nothing to compare


def test_a_profile_from_another_preset_is_judged_by_the_threads_it_was_timed_at(caplog, monkeypatch):
    """`tune --cost-from` keeps the source's timing machine as `cost_machine`; `machine` is where the acceptance was
    measured, at another thread count: the warning reads the profile's."""
    import looped_spec.presets.lookup as lookup
    from looped_spec import load_adapter

    monkeypatch.setattr(lookup, "_told_threads", set())
    preset = preset_for(load_adapter("tiny-ouro"))
    provenance = {**preset.provenance, "machine": {"torch_threads": 2}, "cost_machine": {"torch_threads": 1}}
    preset = preset.model_copy(update={"provenance": provenance})
    with caplog.at_level(logging.WARNING, logger="looped_spec.presets.lookup"):
        lookup.warn_if_timed_at_other_threads(preset, 1)
        assert not caplog.records
        lookup.warn_if_timed_at_other_threads(preset, 2)
    assert len(caplog.records) == 1 and "timed at 1 torch thread(s) and this process runs 2" in caplog.text


def test_another_depth_rounds_half_depths_up():
    """d' = floor(d * D'/D + 1/2): a draft depth landing on a half rounds up (the mutation check, rounding down,
    passed: the rescaled depths tested were whole or clamped)."""
    data = copy.deepcopy(BASE)
    data.update(full_depth=4, acceptance={"alpha": [0.6, 0.8, 0.9, 1.0], "rho": [0.0] * 4})
    data["buckets"][0]["candidates"] = [[1, 1], [2, 3]]
    at6, _ = AdaptiveSpecConfig.parse(data).for_depth(6)  # 1.5 -> 2, 4.5 -> 5
    assert [(c.k, c.d) for c in at6.buckets[0].candidates] == [(1, 2), (2, 5)]
