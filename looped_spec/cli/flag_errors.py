"""The engine's and SamplingParams' errors name their fields (`max_batch_size=0: ...`, `speculation.d=9: ...`); a
command reports them by the flags that set those fields (`--max-batch-size 0: ...`, `--speculation: d=9: ...`)."""

from __future__ import annotations

import argparse
import re

#: fields a flag sets under another name than the flag's
RENAMED_FIELDS = {"trace_path": "--trace", "adapter_options": "--adapter-option"}
#: field values a flag spells differently (EngineConfig.cuda_graphs=True is --cuda-graphs on)
FLAG_VALUES = {"--cuda-graphs": {"True": "on", "False": "off", "None": "auto"}}
#: how an adapter's own errors name its options (`adapter option exit_threshold=-1 ...`): those names are the family's
#: options, set with --adapter-option, even where a flag of the same name sets a field (Huginn's exit_threshold)
ADAPTER_OPTION = "adapter option"
#: fields whose errors name a part as `field.part` (SpeculativeConfig's k, ControlSettings' tunables, a structured
#: output's kind); another field followed by a dot is a word such as a file name (`preset.json`)
FIELDS_WITH_PARTS = frozenset({"speculation", "control", "structured_outputs"})


def flags_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """EngineConfig or SamplingParams field -> the command's long flag that sets it (named as the field, or in
    RENAMED_FIELDS). Only those: a flag such as --model names no field, and a path called `model` is no flag."""
    from looped_spec.engine.config import EngineConfig
    from looped_spec.sampling_params import SamplingParams

    flags = {}
    for action in parser._actions:
        names = [name for name in action.option_strings if name.startswith("--")]
        if names:
            flags[action.dest] = names[0]
    flags |= {field: flag for field, flag in RENAMED_FIELDS.items() if flag in flags.values()}
    fields = set(EngineConfig.model_fields) | set(SamplingParams.model_fields)
    return {field: flag for field, flag in flags.items() if field in fields}


def name_flags(message: str, flags: dict[str, str]) -> str:
    """`message` with each field a flag sets written as that flag: `field=value` as `--flag value`, `field.sub` as
    `--flag: sub`, `field:` as `--flag:`. A field name without `_` (device, seed, policy) is a plain word in a
    sentence, so it is only replaced in those three forms. An adapter's own error names the family's options, not
    fields: only its leading "adapter option" becomes the flag."""
    message = message.removeprefix("LoopedSpecEngine: ")
    if ADAPTER_OPTION in message:
        return (
            message.replace(f"{ADAPTER_OPTION} ", "--adapter-option ", 1)
            if message.startswith(ADAPTER_OPTION)
            else message
        )
    if not flags:
        return message
    names = "|".join(re.escape(name) for name in sorted(flags, key=len, reverse=True))
    # `field=value`; `field=` before a list, dict or string, which stay as written; `field.part` / `field:`; the bare
    # field (not `field=` followed by nothing: prose such as "found without preset=)")
    value = r"'[^'\s]*'|[^\s'\"\[\]{}(),:;]+|(?=[\[{\"])"
    pattern = re.compile(rf"(?<![\w.'\"/-])(?P<field>{names})(?:=(?P<value>{value})|(?P<sep>[.:])|(?![\w=]))")

    def as_flag(match: re.Match) -> str:
        field, flag = match["field"], flags[match["field"]]
        if match["value"] is not None:
            given = match["value"].strip("'")
            return f"{flag} {FLAG_VALUES.get(flag, {}).get(given, given)}"
        if match["sep"] == "." and field not in FIELDS_WITH_PARTS:
            return match[0]
        if match["sep"]:
            return f"{flag}:" + (" " if match["sep"] == "." else "")
        return flag if "_" in field else match[0]

    return pattern.sub(as_flag, message)
