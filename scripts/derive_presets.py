"""Re-derive the presets of models we cannot run here (no checkpoint, no GPU) with the tuner's own rules.

Each preset keeps its assumptions in its provenance (`assumed_alpha_by_depth`, `assumed_n_sat`, their
calibration notes); this script recomputes buckets, candidates and thresholds from them with
`looped_spec.tuning.derive.derive_preset` (the same rules `looped-spec tune` applies to measurements),
so a change of the rules reaches every preset:

    python scripts/derive_presets.py            # rewrite presets/{ouro-1.4b,ouro-2.6b,huginn-0125,...}.json
    python scripts/derive_presets.py --check    # exit 1 if a file differs from what the rules give
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from looped_spec.presets.schema import AdaptiveSpecConfig
from looped_spec.tuning.derive import derive_preset
from looped_spec.tuning.report import dump_json, preset_data

PRESETS = Path(__file__).resolve().parent.parent / "presets"
DERIVED = ("ouro-1.4b", "ouro-2.6b", "huginn-0125", "nanbeige4.2-3b", "default")
METHOD = (
    "looped_spec.tuning.derive.derive_preset (scripts/derive_presets.py): the tuner's rules (docs/adaptive.md) "
    "with the idealised pass-cost profile (tuning/derive.py ideal_cost): a loop pass over n positions costs "
    "1 + n/n_sat units, a readout 8 % of one, and the assumed acceptance per depth (persistence 0) in place of "
    "measurements"
)


def derive(name: str) -> str:
    path = PRESETS / f"{name}.json"
    old = json.loads(path.read_text())
    prov = dict(old["provenance"])
    prov["method"] = METHOD
    data = derive_preset(
        old["model"],
        old["full_depth"],
        prov["assumed_alpha_by_depth"],
        prov["assumed_n_sat"],
        hardware=old["hardware"],
        bucket_knobs={"beta": 0.2, "min_samples": 8, "interval": 4},
        disable={"probe_base": 32, "probe_cap": 1024},
        provenance=prov,
        model_type=old.get("model_type"),
    )
    if name == "default":  # a family-generic preset: per-depth acceptance of no model in particular
        del data["acceptance"]
    return dump_json(preset_data(AdaptiveSpecConfig.parse(data, source=str(path))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = parser.parse_args()
    stale = []
    for name in DERIVED:
        path = PRESETS / f"{name}.json"
        text = derive(name)
        if path.read_text() != text:
            stale.append(name)
            if not args.check:
                path.write_text(text)
    verb = "differ" if args.check else "rewritten"
    print(f"{verb}: {', '.join(stale) or 'none'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
