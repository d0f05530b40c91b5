"""`looped-spec serve`: the OpenAI-compatible server, one engine or Ray Serve replicas; `looped-spec models`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from looped_spec.cli.common import (
    API_KEY_ENV,
    UsageError,
    add_engine_flags,
    at_least,
    engine_options,
    output_file,
    set_threads,
)
from looped_spec.logs import configure_logging


def add_parser(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> None:
    srv = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        formatter_class=fmt,
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /version, "
        "/health and /metrics with FastAPI + uvicorn. Only /v1/* needs the API key (as in vLLM).",
    )
    srv.add_argument("model", nargs="?", default=None,
                     help="checkpoint folder or shipped model name (default: tiny-ouro)")  # fmt: skip
    srv.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                     help="the model as a flag, the same as the positional one (vLLM's `vllm serve` takes "
                     "either); both given must be the same (default: the positional model)")  # fmt: skip
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port")
    srv.add_argument(
        "--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set)"
    )
    srv.add_argument("--served-model-name", default=None, help="model id in the API (default: folder name)")
    srv.add_argument(
        "--max-queued",
        type=int,
        default=256,
        help="requests that may wait beyond the running batch (with replicas: in Ray's queue, at least 1); more "
        "get 429 + Retry-After",
    )
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    ray_flags = srv.add_argument_group("replicas (Ray Serve; pip install -e '.[ray]')")
    ray_flags.add_argument("--replicas", type=int, default=None, help="serve with this many engine replicas behind "
                           "Ray Serve's proxy (on CUDA one GPU each; RAY_ADDRESS joins a running cluster) (default: "
                           "one engine in this process, without Ray)")  # fmt: skip
    ray_flags.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (default: 1)")
    ray_flags.add_argument(
        "--max-replicas", type=int, default=None, help="autoscaling: most replicas (default: none, a fixed count)"
    )
    ray_flags.add_argument("--target-ongoing-requests", type=float, default=None,
                           help="autoscaling: in-flight requests per replica it aims at (default: Ray "
                           "Serve's)")  # fmt: skip
    ray_flags.add_argument("--metrics-port", type=int, default=None,
                           help="with --replicas or --max-replicas: replica r also serves its /metrics on port + r, "
                           "labelled by replica (default: no port of its own; the single-process server's /metrics "
                           "is on --port)")  # fmt: skip
    tools = srv.add_argument_group('tool calling (chat completions\' tools; named and "required" need no flag)')
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='serve tool_choice "auto" (the default with tools): the model may call, and '
                       "--tool-call-parser finds its calls in the text")  # fmt: skip
    tools.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="the format the model writes its calls in, for tool_choice auto: only with "
                       "--enable-auto-tool-choice (hermes; an unknown name lists the known ones) (default: "
                       "none)")  # fmt: skip
    chat = srv.add_argument_group("chat (chat completions and /tokenize)")
    chat.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                      help="render every chat request with this Jinja template instead of the tokenizer's (so a model "
                      "without one serves chat): a file, or the template itself when it names no file and holds '{', "
                      "'}' or a newline (vLLM's rule) (default: the tokenizer's own)")  # fmt: skip
    chat.add_argument("--trust-request-chat-template", action="store_true",
                      help="let a request's own chat_template field render its prompt (refused by default: a "
                      "template is code the server runs)")  # fmt: skip
    chat.add_argument("--reasoning-parser", default=None, metavar="NAME",
                      help="take a thinking model's <think> reasoning apart from its answer in chat replies "
                      "(message.reasoning): deepseek_r1 (the template may open it) or qwen3 (the model opens it) "
                      "(default: none, replies as generated)")  # fmt: skip
    srv.add_argument("--return-tokens-as-token-ids", action="store_true",
                     help="log-probabilities show each token as 'token_id:<id>' (exact whatever its bytes) unless a "
                     "request's return_tokens_as_token_ids says otherwise")  # fmt: skip
    srv.add_argument("--early-exit", default="skip", choices=["skip", "select"],
                     help="how requests' exit_threshold / exit_at_step run (with or without speculation)")  # fmt: skip
    add_engine_flags(srv, "serve")
    srv.set_defaults(func=serve_command, command_parser=srv)
    models = sub.add_parser("models", help="list the shipped tiny models", formatter_class=fmt)
    models.set_defaults(func=list_models, command_parser=models)


def served_model(args: argparse.Namespace) -> str:
    """The model: the positional argument or --model (vLLM's `vllm serve` takes either), tiny-ouro by default."""
    if args.model is not None and args.model_flag is not None and args.model != args.model_flag:
        raise UsageError(f"--model {args.model_flag} and the positional model {args.model} differ: give the model "
                         "once")  # fmt: skip
    given = args.model if args.model is not None else args.model_flag
    return given if given is not None else "tiny-ouro"


def tool_calling_config(args: argparse.Namespace):
    """The server's ToolCallingConfig from the flags (UsageError naming them)."""
    from pydantic import ValidationError

    from looped_spec.server.tools import ToolCallingConfig

    try:
        return ToolCallingConfig(enable_auto_tool_choice=args.enable_auto_tool_choice,
                                 tool_call_parser=args.tool_call_parser)  # fmt: skip
    except ValidationError as exc:
        raise UsageError("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None


def chat_template_config(args: argparse.Namespace):
    """The server's ChatTemplateConfig from the flags: the template read and compiled before the engine loads
    (UsageError naming the flag)."""
    from pydantic import ValidationError

    from looped_spec.server.chat_template import ChatTemplateConfig, read_chat_template

    try:
        text = read_chat_template(args.chat_template) if args.chat_template is not None else None
        return ChatTemplateConfig(chat_template=text, trust_request_chat_template=args.trust_request_chat_template)
    except ValidationError as exc:
        problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise UsageError(f"--chat-template {shown(args.chat_template)}: {problems}") from None
    except ValueError as exc:
        raise UsageError(f"--chat-template: {exc}") from None


def shown(value: str, most: int = 60) -> str:
    """A flag's value as an error message quotes it (a template written inline can be long)."""
    return repr(value if len(value) <= most else value[:most] + "...")


def serve_command(args: argparse.Namespace) -> int:
    from looped_spec import LoopedSpecEngine
    from looped_spec.server.launch import serve

    args.model = served_model(args)
    if args.api_key is not None and not args.api_key.strip():  # `--api-key "$KEY"` with KEY unset: not an open server
        raise UsageError(f"--api-key {args.api_key!r}: is empty; give the key, or leave --api-key out (then "
                         f"${API_KEY_ENV} if set, else no key)")  # fmt: skip
    if args.served_model_name is not None and not args.served_model_name.strip():  # not a name clients can send
        raise UsageError(f"--served-model-name {args.served_model_name!r}: is empty; give a name, or leave it out "
                         "(then the model folder's name)")  # fmt: skip
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    tool_calling = tool_calling_config(args)
    chat_template = chat_template_config(args)
    if args.reasoning_parser is not None:
        from looped_spec.reasoning import reasoning_parser

        try:
            reasoning_parser(args.reasoning_parser)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    scaling = dict(num_replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                   target_ongoing_requests=args.target_ongoing_requests, metrics_port=args.metrics_port)  # fmt: skip
    at_least(args.threads, 0, "--threads", " (0: torch's default)")
    if args.trace is not None:  # before the model loads, as generate checks it
        output_file(args.trace, "--trace")
    if not args.host.strip():  # asyncio's create_server binds "" to every interface: `--host "$HOST"` unset exposes it
        raise UsageError(f"--host {args.host!r}: is empty; give an address (127.0.0.1: this machine only, the default; "
                         "0.0.0.0: every interface)")  # fmt: skip
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: must be in 0..65535")
    at_least(args.max_queued, 0, "--max-queued")
    at_least(args.max_body_bytes, 1, "--max-body-bytes")
    if args.metrics_port is not None and args.replicas is None and args.max_replicas is None:
        raise UsageError(f"--metrics-port {args.metrics_port}: only with --replicas or --max-replicas (Ray Serve "
                         "replica r serves /metrics on port + r); one engine in this process serves /metrics on "
                         "--port")  # fmt: skip
    if args.metrics_port is not None:
        last = args.metrics_port + (args.replicas or args.max_replicas or 1) - 1
        if args.metrics_port <= args.port <= last:  # that replica would fail at every start, retried by Ray
            raise UsageError(f"--metrics-port {args.metrics_port}: the replicas serve /metrics on ports "
                             f"{args.metrics_port}..{last}, which holds Ray's proxy on --port {args.port}")  # fmt: skip
    if any(value is not None for value in scaling.values()):
        return serve_replicas(args, api_key, scaling, tool_calling, chat_template)
    set_threads(args.threads)
    configure_logging(args.log_level)
    engine = LoopedSpecEngine(args.model, **engine_options(args))
    name = args.served_model_name or Path(str(args.model)).name
    serve(engine, name, host=args.host, port=args.port, api_key=api_key, max_queued=args.max_queued,
          max_body_bytes=args.max_body_bytes, log_level=args.log_level, tool_calling=tool_calling,
          chat_template=chat_template, reasoning_parser=args.reasoning_parser,
          return_tokens_as_token_ids=args.return_tokens_as_token_ids)  # fmt: skip
    return 0


_REPLICA_FLAGS = {"num_replicas": "--replicas", "min_replicas": "--min-replicas", "max_replicas": "--max-replicas",
                  "target_ongoing_requests": "--target-ongoing-requests", "metrics_port": "--metrics-port",
                  "max_queued": "--max-queued"}  # fmt: skip


def serve_replicas(args: argparse.Namespace, api_key: str | None, scaling: dict, tool_calling, chat_template) -> int:
    """`serve` with replicas: the same app under Ray Serve, one engine per replica (server/replicas.py)."""
    try:
        from looped_spec.server.replicas import ProxyAddressError, ReplicaAppArgs, parse_args, run_replicas
    except ImportError as exc:
        raise UsageError(f"--replicas needs Ray Serve ({exc}): pip install -e '.[ray]'") from None
    options = engine_options(args)
    options = {key: value for key, value in options.items() if value is not None}  # JSON-able, defaults left out
    if options.get("dtype") is not None:
        options["dtype"] = str(options["dtype"])
    given = {key: value for key, value in scaling.items() if value is not None}
    try:
        app_args: ReplicaAppArgs = parse_args(dict(model=str(args.model), served_model_name=args.served_model_name,
                                                   api_key=api_key, max_queued=args.max_queued,
                                                   max_body_bytes=args.max_body_bytes, threads=args.threads,
                                                   log_level=args.log_level,
                                                   engine=options, tool_calling=tool_calling.model_dump(),
                                                   chat_template=chat_template.model_dump(),
                                                   reasoning_parser=args.reasoning_parser,
                                                   return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                                                   **given))  # fmt: skip
        app_args.check_before_start()
    except ValueError as exc:  # name the flags, not the application's fields
        from looped_spec.cli.flag_errors import flags_of, name_flags

        message = str(exc).removeprefix("looped-spec application args: ").removeprefix("engine: ")
        message = name_flags(message, flags_of(args.command_parser))  # the engine's fields
        for field, flag in _REPLICA_FLAGS.items():
            message = message.replace(field, flag)
        if message.startswith(f"{args.model}: "):  # the loader names the path or name given, as one engine's does
            message = f"--model {message}"
        raise UsageError(message) from None
    try:
        run_replicas(app_args, args.host, args.port)
    except ProxyAddressError as exc:  # the cluster joined serves HTTP elsewhere (it names the flags)
        raise UsageError(str(exc)) from None
    return 0


def list_models(args: argparse.Namespace) -> int:
    from looped_spec.models import shipped_models

    for name, path in shipped_models().items():
        print(f"{name}\t{path}")
    return 0
