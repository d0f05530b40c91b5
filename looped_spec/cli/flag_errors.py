"""The engine's and SamplingParams' errors name their fields (`max_batch_size=0: ...`, `speculation.d=9: ...`); a
command reports them by the flags that set those fields (`--max-batch-size 0: ...`, `--speculation: d=9: ...`). A flag
the command does not take is argparse's error, with the flag a misspelt one was likely meant to be, and for vLLM's
flags what stands for each here."""

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
#: vLLM's flags above that take no value (switches: an argument after one is not its); `--lora-modules` takes several
VLLM_SWITCHES = frozenset({
    "enforce_eager", "trust_remote_code", "enable_chunked_prefill", "enable_prefix_caching", "async_scheduling",
    "disable_log_requests", "enable_log_requests", "disable_log_stats", "disable_uvicorn_access_log", "enable_lora",
})  # fmt: skip
VLLM_MANY_VALUES = frozenset({"lora_modules"})
#: vLLM's short flags, by the engine argument each sets
VLLM_SHORT_FLAGS = {"-tp": "tensor_parallel_size", "-pp": "pipeline_parallel_size"}
#: `vllm serve`'s own flags, not engine arguments (vllm/entrypoints/openai/cli_args.py; the commonly used ones): what
#: stands for each in `looped-spec serve`. Its engine arguments are EngineConfig's VLLM_OPTIONS, told in every command
#: with the engine flags, their fields named as flags.
VLLM_SERVE_FLAGS = {
    "uvicorn_log_level": "here --log-level (uvicorn's lines and looped-spec's own alike)",
    "disable_uvicorn_access_log": "here --log-level warning hides uvicorn's access lines (and looped-spec's info "
    "lines with them)",
    "disable_log_requests": "not needed: requests are not logged here (but for uvicorn's access line of each, which "
    "--log-level warning hides, and a warning for one that fails)",
    "enable_log_requests": "not offered: a request's parameters are not logged; uvicorn's access line shows each "
    "request at --log-level info",
    "disable_log_stats": "not needed: no periodic stats lines are logged here; GET /metrics serves them",
    "allowed_origins": "not offered: the server sends no CORS headers (for a browser page of another origin, put a "
    "proxy in front that adds them)",
    "ssl_keyfile": "not offered: the server speaks plain HTTP (terminate TLS in a proxy in front of it)",
    "ssl_certfile": "not offered: the server speaks plain HTTP (terminate TLS in a proxy in front of it)",
    "root_path": "not offered: the routes are served from / (a proxy routing by a path prefix must strip it)",
    "middleware": "not offered: the server loads no ASGI middleware of yours",
    "lora_modules": "not offered: no LoRA adapters here; the checkpoint is served as it is",
    "api_server_count": "one API server process here; --replicas N scales out with Ray Serve",
}


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


def unrecognized(unknown: list[str], parser: argparse.ArgumentParser, *, engine_flags: bool, serve: bool) -> str:
    """argparse's error for the arguments `parser` does not take: each of vLLM's flags with what stands for it (vLLM's
    engine arguments where the command has the engine flags, `vllm serve`'s own in serve), then the rest, with the
    flag a misspelt one was likely meant to be. A vLLM flag's own value goes with it (none after a switch or
    `--flag=value`); any further argument is named."""
    answers, rest, values = [], [], 0  # values: how many arguments next are the last vLLM flag's
    for arg in unknown:
        if arg.startswith("-") and not _number(arg):
            flag = arg.split("=", 1)[0]
            answer = _vllm_answer(flag, parser, engine_flags=engine_flags, serve=serve)
            values = 0
            if answer is not None:
                answers.append(answer)
                name = _vllm_name(flag)
                if "=" not in arg and name not in VLLM_SWITCHES:
                    values = len(unknown) if name in VLLM_MANY_VALUES else 1
                continue
        elif values:
            values -= 1
            continue
        rest.append(arg)
    if rest:
        answers.append(f"unrecognized arguments: {' '.join(rest)}{_did_you_mean(rest, parser)}")
    return "; ".join(answers)


def _number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def _vllm_answer(flag: str, parser: argparse.ArgumentParser, *, engine_flags: bool, serve: bool) -> str | None:
    """`--flag: vLLM's flag; what stands for it` (None: not a vLLM flag told in this command). vLLM takes `_` for `-`.
    VLLM_OPTIONS speaks of fields: those the command has a flag for are named as the flag."""
    from looped_spec.engine.config import VLLM_OPTIONS

    name = _vllm_name(flag)
    if engine_flags and name in VLLM_OPTIONS:
        return f"{flag}: vLLM's flag; {name_flags(VLLM_OPTIONS[name], flags_of(parser))}"
    if serve and name in VLLM_SERVE_FLAGS:
        return f"{flag}: vLLM's flag; {VLLM_SERVE_FLAGS[name]}"
    return None


def _vllm_name(flag: str) -> str | None:
    """The vLLM argument `flag` sets (`--max-num-seqs`, `--max_num_seqs`: max_num_seqs; `-tp`)."""
    return VLLM_SHORT_FLAGS.get(flag) or (flag[2:].replace("-", "_") if flag.startswith("--") else None)


def _did_you_mean(rest: list[str], parser: argparse.ArgumentParser) -> str:
    """` (did you mean --flag?)` for the one unknown flag; with several, which flag each was likely meant to be."""
    import difflib

    flags = [name for action in parser._actions for name in action.option_strings if name.startswith("--")]
    given = [arg.split("=", 1)[0] for arg in rest if arg.startswith("--")]
    close = [(match[0], name) for name in given if (match := difflib.get_close_matches(name, flags, n=1, cutoff=0.8))]
    if not close:
        return ""
    if len(given) == 1:
        return f" (did you mean {close[0][0]}?)"
    return f" (did you mean {' and '.join(f'{flag} instead of {name}' for flag, name in close)}?)"
