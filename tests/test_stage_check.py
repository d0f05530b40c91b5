"""A family's declarations are checked against its stages when an engine starts (models/stage_check.py): a wrong
one is an error naming it, not an index error in the KV cache, a failure on the graph path only, or other tokens."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, fixture_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from custom_family import ToyLoopedAdapter, make_toy_checkpoint  # noqa: E402

from looped_spec import KVLayout, LoopedSpecEngine, load_adapter  # noqa: E402
from looped_spec.models.stage_check import check_stages  # noqa: E402


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return load_adapter(make_toy_checkpoint(tmp_path_factory.mktemp("toy") / "toy"), dtype="float32", device="cpu")


def variant(toy, **overrides):
    cls = type("Variant", (ToyLoopedAdapter,), {"model_type": "toy_variant", **overrides})
    return cls(toy.config, toy.weights)


def test_the_shipped_families_and_the_example_pass(toy):
    for family in FAMILIES:
        check_stages(load_adapter(fixture_dir(family)))
    for name in ("tiny-ouro", "tiny-huginn", "tiny-nanbeige"):
        check_stages(load_adapter(name))
    check_stages(load_adapter("tiny-huginn", num_steps=5))
    check_stages(toy)
    check_stages(variant(toy, uniform_loops=False))  # the toy's loops are uniform; not declaring it is allowed
    check_stages(variant(toy, loop=swapped_loop, kv_layout=property(two_planes_a_loop), uniform_loops=False))
    check_stages(variant(toy, readout=attending_readout, kv_layout=property(one_more_plane), readout_uses_kv=True))
    check_stages(variant(toy, has_exit_rule=True, exit_rule_uses_depth=False, exit_rule=latent_exit_rule))
    check_stages(variant(toy, has_exit_rule=True, exit_rule=latent_exit_rule_from_depth_2))  # declared: allowed
    check_stages(variant(toy, has_exit_rule=True, exit_rule=confident_exit_rule))  # hands over its readout's logits
    check_stages(variant(toy, has_exit_rule=True, exit_carry=two_column_carry, exit_rule=counting_exit_rule))
    check_stages(variant(toy, readout_hidden=lambda self, s, depth, ctx: s, head=toy_head))  # a split readout


def wider_loop(self, state, loop_index, ctx):
    return ToyLoopedAdapter.loop(self, state, loop_index, ctx) * (1.0 + 0.5 * loop_index)


def embed_on_a_loop_plane(self, token_ids, ctx):
    return ToyLoopedAdapter.loop(self, ToyLoopedAdapter.embed(self, token_ids, ctx), 0, ctx)  # attends on plane 0


def swapped_loop(self, state, loop_index, ctx):
    """Two layers of the toy's math, on the loop's two planes; after loop 0 in the other order."""
    first, second = 2 * loop_index, 2 * loop_index + 1
    if loop_index:
        first, second = second, first
    return ToyLoopedAdapter.loop(self, ToyLoopedAdapter.loop(self, state, first, ctx), second, ctx)


def two_planes_a_loop(self):
    return KVLayout(2 * self.full_depth, 1, 16, 2 * self.full_depth)


def seeded_embed(self, token_ids, ctx):
    ctx.token_seeds()
    return ToyLoopedAdapter.embed(self, token_ids, ctx)


def attending_readout(self, state, depth, ctx):  # a coda layer on the plane after the loops'
    return ToyLoopedAdapter.readout(self, ToyLoopedAdapter.loop(self, state, self.full_depth, ctx), depth, ctx)


def toy_head(self, hidden):
    return ToyLoopedAdapter.readout(self, hidden, self.full_depth, None)


def one_more_plane(self):
    return KVLayout(self.full_depth + 1, 1, 16, self.full_depth)


def latent_exit_rule(self, state, depth, prev_state, carry, threshold, ctx):
    """A token exits once its state moves less than `threshold` (relative) in a loop: the rule ignores its depth."""
    change = (state - prev_state).norm(dim=-1) / state.norm(dim=-1).clamp_min(1e-12)
    return change < threshold, carry, None


def latent_exit_rule_from_depth_2(self, state, depth, prev_state, carry, threshold, ctx):
    exits, carry, logits = latent_exit_rule(self, state, depth, prev_state, carry, threshold, ctx)
    return exits & (depth >= 2), carry, logits


def confident_exit_rule(self, state, depth, prev_state, carry, threshold, ctx):
    """A token exits once its readout's top probability reaches `threshold`; the rule hands those logits over."""
    logits = ToyLoopedAdapter.readout(self, state, depth, ctx)
    return logits.softmax(-1).amax(-1) >= threshold, carry, logits


def narrow_logits_exit_rule(self, state, depth, prev_state, carry, threshold, ctx):
    exits, carry, logits = confident_exit_rule(self, state, depth, prev_state, carry, threshold, ctx)
    return exits, carry, logits[:, :10]


def float_mask_exit_rule(self, state, depth, prev_state, carry, threshold, ctx):
    exits, carry, logits = latent_exit_rule(self, state, depth, prev_state, carry, threshold, ctx)
    return exits.float(), carry, logits


def two_column_carry(self, num_rows):
    return torch.zeros(num_rows, 2)


def counting_exit_rule(self, state, depth, prev_state, carry, threshold, ctx):
    """Carries (loops run, last change) from loop to loop."""
    exits, _, logits = latent_exit_rule(self, state, depth, prev_state, None, threshold, ctx)
    return exits, torch.stack([carry[:, 0] + 1, exits.float()], dim=-1), logits


def flat_carry_exit_rule(self, state, depth, prev_state, carry, threshold, ctx):
    exits, carry, logits = counting_exit_rule(self, state, depth, prev_state, carry, threshold, ctx)
    return exits, carry[:, 0], logits


CASES = {
    "state_dim": ({"state_dim": property(lambda self: 8)}, r"embed returned \[2, 16\]; expected \[tokens, state_dim=8"),
    "vocab_size": ({"vocab_size": property(lambda self: 30)}, r"readout at depth 1 returned \[2, 32\].*vocab_size=30"),
    "kv heads": (
        {"kv_layout": property(lambda self: KVLayout(3, 2, 8, 3))},
        r"keys of shape \[2, 1, 16\] on plane 0; kv_layout declares \[tokens, num_kv_heads=2, head_dim=8\]",
    ),
    "planes a loop": (
        {"kv_layout": property(lambda self: KVLayout(4, 1, 16, 4))},
        r"num_loop_planes=4 is not a multiple of full_depth=3",
    ),
    "loop planes": (
        {"kv_layout": property(lambda self: KVLayout(4, 1, 16, 3, first_loop_plane=1))},
        r"loop 0 attends on KV planes \[0\], outside its planes \[1\]",
    ),
    "embed planes": ({"embed": embed_on_a_loop_plane}, r"embed attends on loop planes \[0\]"),
    "loop order": (
        {"uniform_loops": True, "loop": swapped_loop, "kv_layout": property(two_planes_a_loop)},
        r"uniform_loops=True, but loop 1 is not loop 0 on moved planes",
    ),
    "embed context": (
        {"embed_uses_context": False, "embed": seeded_embed},
        r"declares embed_uses_context=False, but embed draws per-token seeds",
    ),
    "readout kv": (
        {"readout": attending_readout, "kv_layout": property(one_more_plane)},
        r"declares readout_uses_kv=False, but readout attends",
    ),
    "uniform loops": ({"uniform_loops": True, "loop": wider_loop}, r"uniform_loops=True, but loop 1 is not loop 0"),
    "uniform readout": (
        {"uniform_loops": True, "readout": lambda self, s, d, ctx: ToyLoopedAdapter.readout(self, s, d, ctx) * d},
        r"uniform_loops=True, but readout\(state, 1\) differs from readout\(state, 3\)",
    ),
    "exit rule depth": (
        {"has_exit_rule": True, "exit_rule_uses_depth": False, "exit_rule": latent_exit_rule_from_depth_2},
        r"declares exit_rule_uses_depth=False, but exit_rule\(state, 1, ...\) differs from exit_rule\(state, 2, ...\)",
    ),
    "exit logits": (
        {"has_exit_rule": True, "exit_rule": narrow_logits_exit_rule},
        r"exit_rule\(state, 1, ...\) returned logits \(torch.float32 \[2, 10\]\) other than readout\(state, 1\)'s",
    ),
    "exit mask": (
        {"has_exit_rule": True, "exit_rule": float_mask_exit_rule},
        r"exit_rule returned exits torch.float32 \[2\]; expected a torch.bool tensor \[rows=2\]",
    ),
    "exit carry": (
        {"has_exit_rule": True, "exit_carry": two_column_carry, "exit_rule": flat_carry_exit_rule},
        r"exit_rule returned a carry of shape \[2\]; exit_carry\(2\) gives \[2, 2\]",
    ),
    "head split": (
        {"readout_hidden": lambda self, s, depth, ctx: s * 2.0, "head": toy_head},
        r"head\(readout_hidden\(state, 1\)\) differs from readout\(state, 1\)",
    ),
    "head missing": (
        {"readout_hidden": lambda self, s, depth, ctx: s},
        r"readout_hidden splits the readout, but the family defines no head",
    ),
    "logits dtype": (
        {"readout": lambda self, s, depth, ctx: ToyLoopedAdapter.readout(self, s, depth, ctx).double()},
        r"readout returned torch.float64 logits",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_wrong_declaration_is_named(toy, case):
    overrides, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        check_stages(variant(toy, **overrides))


def test_an_engine_refuses_a_family_whose_declarations_do_not_hold(toy):
    overrides, message = CASES["uniform loops"]
    with pytest.raises(ValueError, match=message):
        LoopedSpecEngine(variant(toy, **overrides), speculation="off")


def test_an_exit_rule_handing_over_other_logits_is_refused_not_decoded(toy):
    """An exit rule's logits are taken as its exited rows' readout: ones of another width than the vocabulary gave
    plain decoding other tokens than speculative decoding, without an error. The engine refuses the family at start."""
    overrides, message = CASES["exit logits"]
    for speculation in ("off", "2,1"):
        with pytest.raises(ValueError, match=message):
            LoopedSpecEngine(variant(toy, **overrides), speculation=speculation)


def test_a_config_field_read_only_by_the_stages_is_named_with_its_file(toy):
    """A family that reads a config.json field in a stage (as the example reads config["hidden"] in its loop), on a
    checkpoint that lacks it: the engine's start names the file and the field, not a bare KeyError 'rope_theta'."""

    def loop_reading_theta(self, state, loop_index, ctx):
        return ToyLoopedAdapter.loop(self, state, loop_index, ctx) * (self.config["rope_theta"] > 0)

    cls = type("Variant", (ToyLoopedAdapter,), {"model_type": "toy_variant", "loop": loop_reading_theta})
    adapter = cls(toy.config, toy.weights, path=toy.path)
    config_json = str(Path(toy.path) / "config.json")
    with pytest.raises(ValueError, match=rf"^{re.escape(config_json)}: missing field rope_theta"):
        LoopedSpecEngine(adapter, speculation="off")
    LoopedSpecEngine(cls({**toy.config, "rope_theta": 1e4}, toy.weights, path=toy.path), speculation="off")  # has it
    without_head = {name: tensor for name, tensor in toy.weights.items() if name != "head"}
    with pytest.raises(KeyError, match="head"):  # a tensor the family reads and the file lacks is no config field
        check_stages(cls({**toy.config, "rope_theta": 1e4}, without_head, path=toy.path))


def test_a_kv_layout_that_cannot_hold_its_loop_planes_is_refused():
    with pytest.raises(ValueError, match=r"loop planes 2..5 .* do not fit in num_planes=5"):
        KVLayout(5, 1, 16, 4, first_loop_plane=2)
    with pytest.raises(ValueError, match=r"KVLayout.num_kv_heads=0 must be an integer >= 1"):
        KVLayout(4, 0, 16, 4)
    with pytest.raises(ValueError, match=r"KVLayout.head_dim=16.0 must be an integer"):
        KVLayout(4, 1, 16.0, 4)
