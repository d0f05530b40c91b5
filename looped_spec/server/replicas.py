"""Ray Serve replicas: the same FastAPI app, one engine per replica, behind Ray's HTTP proxy.

`looped-spec serve MODEL --replicas N` (or `--min-replicas/--max-replicas`) runs this on a local Ray
cluster (or the one `RAY_ADDRESS` names); `serve run examples/ray_serve.yaml` and KubeRay's RayService take
`build_application` with the same arguments (`ReplicaAppArgs`). Ray routes each request to one replica;
everything inside a replica is the single-process server (server/app.py). docs/serving.md has the
commands, the config file and how to scrape each replica's metrics.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path
from typing import Any, Literal

import ray
from prometheus_client import start_http_server
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from ray import serve
from ray.serve.config import AutoscalingConfig, BackpressureConfig

from looped_spec.engine.async_engine import AsyncLoopedSpecEngine
from looped_spec.engine.config import EngineConfig
from looped_spec.engine.engine import LoopedSpecEngine
from looped_spec.engine.model_options import check_model_options
from looped_spec.logs import configure_logging
from looped_spec.reasoning import reasoning_parser
from looped_spec.server.app import build_app
from looped_spec.server.chat_template import ChatTemplateConfig
from looped_spec.server.serving import RETRY_AFTER_S
from looped_spec.server.tools import ToolCallingConfig

APP_NAME = "looped-spec"
DEPLOYMENT_NAME = "LoopedSpecServer"
API_KEY_ENV = "LOOPED_SPEC_API_KEY"


class ReplicaAppArgs(BaseModel):
    """The application's arguments (`args:` in a Serve config file; `looped-spec serve` fills them from its flags)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("tiny-ouro", description="Checkpoint folder or shipped model name, as every replica sees it.")
    served_model_name: str | None = Field(None, description="Model id in the API (default: the folder name).")
    api_key: str | None = Field(None, description=f"Bearer key for /v1/* (default: ${API_KEY_ENV} on the replica).")
    max_queued: int = Field(256, ge=1, description="Requests that may wait beyond the replicas' running batches, in "
                            "Ray's queue (at least 1); more get 429 with Retry-After.")  # fmt: skip
    max_body_bytes: int = Field(1 << 20, ge=1, description="Larger request bodies get 413.")
    threads: int = Field(1, ge=0, description="torch CPU threads per replica (0: torch's default).")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="looped-spec's own log lines in each replica's log (its startup lines at info)."
    )
    engine: dict[str, Any] = Field(default_factory=dict, description="LoopedSpecEngine options (EngineConfig).")
    tool_calling: ToolCallingConfig = Field(default_factory=ToolCallingConfig,
                                            description='How tool_choice "auto" is served.')  # fmt: skip
    chat_template: ChatTemplateConfig = Field(default_factory=ChatTemplateConfig, description="The server's chat "
                                              "template (its text: `looped-spec serve --chat-template FILE` reads "
                                              "the file) and whether a request may bring its own.")  # fmt: skip
    reasoning_parser: str | None = Field(None, description="How chat replies' reasoning is taken apart from their "
                                         "content (deepseek_r1, qwen3; default: replies as generated).")  # fmt: skip
    num_replicas: int | None = Field(None, ge=1, description="Fixed replica count (default 1 without autoscaling).")
    min_replicas: int | None = Field(None, ge=0, description="Autoscaling: fewest replicas.")
    max_replicas: int | None = Field(None, ge=1, description="Autoscaling: most replicas.")
    target_ongoing_requests: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="Autoscaling: requests per replica aimed at."
    )
    num_gpus: float | None = Field(None, ge=0, description="GPUs per replica (default: 1 when the engine's device is "
                                   "cuda, or auto on a cluster with GPUs; else 0).")  # fmt: skip
    metrics_port: int | None = Field(None, ge=1, le=65535, description="Replica with local rank r also serves "
                                     "/metrics on metrics_port + r (each series labelled by replica).")  # fmt: skip

    return_tokens_as_token_ids: bool = Field(False, description="Log-probabilities show tokens as 'token_id:<id>' "
                                             "unless a request says otherwise.")  # fmt: skip

    @field_validator("api_key", "served_model_name")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        # a blank key would serve /v1/* with none (`api_key: "${KEY}"` with KEY unset), a blank name be no model id
        if value is not None and not value.strip():
            raise ValueError("is empty: give one, or leave it out")
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, name: str | None) -> str | None:
        if name is not None:
            reasoning_parser(name)  # ValueError listing the known ones
        return name

    @model_validator(mode="after")
    def _scaling(self) -> ReplicaAppArgs:
        autoscaling = [n for n in ("min_replicas", "max_replicas", "target_ongoing_requests") if getattr(self, n)
                       is not None]  # fmt: skip
        if autoscaling and self.num_replicas is not None:
            raise ValueError(f"num_replicas: a fixed count excludes autoscaling ({', '.join(autoscaling)})")
        if autoscaling and self.max_replicas is None:
            raise ValueError("max_replicas: autoscaling needs the most replicas it may start")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} exceeds max_replicas={self.max_replicas}")
        replicas = self.num_replicas or self.max_replicas or 1
        if self.metrics_port is not None and self.metrics_port + replicas - 1 > 65535:
            raise ValueError(f"metrics_port={self.metrics_port}: {replicas} replicas serve /metrics on ports up to "
                             f"{self.metrics_port + replicas - 1}, past 65535")  # fmt: skip
        return self

    def check_before_start(self) -> EngineConfig:
        """What the driver can check before Ray starts a replica (which would fail, be retried and end in Ray's
        traceback): the engine options, the model's folder and family, its adapter options, the engine options that
        depend on the model (on its weightless description), a preset asked for, a CUDA device on a local cluster."""
        from looped_spec.models.adapter import (
            adapter_class,
            describe_adapter,
            found_by_every_process,
            resolve_model_path,
        )
        from looped_spec.models.checkpoint import read_config
        from looped_spec.presets.lookup import preset_path, read_preset_file

        config = self.engine_config()
        folder = resolve_model_path(self.model)
        model_config = read_config(folder)
        model_type = model_config.get("model_type")
        if isinstance(model_type, str):  # (a config without one fails in the replica with the loader's message)
            family = adapter_class(model_type, str(folder / "config.json"))  # unknown: says how a family is added
            family.checked_options(config.adapter_options or {}, model_config)  # a misspelt option or a bad value
            if not found_by_every_process(model_type):
                raise ValueError(
                    f"{folder / 'config.json'}: model_type {model_type!r} is registered in this process only; Ray "
                    "Serve replicas run in processes of their own: install the family as a package with an entry "
                    "point in the 'looped_spec.adapters' group (docs/architecture.md, 'Adding a family')"
                )
            # the engine options that depend on the model (its depth, its positions, the preset for its depth),
            # on the model described without its weights
            model = describe_adapter(folder, **(config.adapter_options or {}))
            if model is not None:
                check_model_options(config, model)
        if isinstance(config.preset, (str, os.PathLike)):
            read_preset_file(preset_path(config.preset)[0])
        if str(config.device).startswith("cuda") and not os.environ.get("RAY_ADDRESS"):
            import torch

            if not torch.cuda.is_available():
                device = str(config.device)
                raise ValueError(f"engine.device={device!r}: no CUDA device here, and a local Ray cluster would wait "
                                 "for one forever (RAY_ADDRESS deploys onto one with GPUs)")  # fmt: skip
        return config

    def engine_config(self) -> EngineConfig:
        """The engine options, checked before any replica starts (the error names `engine.<option>`)."""
        try:
            return EngineConfig.from_options(**self.engine)
        except ValueError as exc:
            raise ValueError(f"engine: {exc}") from None


def parse_args(args: dict[str, Any] | ReplicaAppArgs) -> ReplicaAppArgs:
    """`ReplicaAppArgs` from a config file's `args:`; a wrong field is a ValueError naming it."""
    if isinstance(args, ReplicaAppArgs):
        return args
    try:
        return ReplicaAppArgs(**args)
    except ValidationError as exc:
        # a check across fields (no loc) names its field in its message
        problems = [(f"{'.'.join(map(str, e['loc']))}: " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
                    for e in exc.errors()]  # fmt: skip
        raise ValueError("looped-spec application args: " + "; ".join(problems)) from None


def replica_engine_options(engine: dict[str, Any], replica: str, rank: int) -> dict[str, Any]:
    """A replica's engine options (`rank`: the replica's among the deployment's). Its engine seed is the deployment's
    plus its rank: requests without a seed draw theirs from it, and replicas of one seed would draw the same seeds in
    the same order (the first sampled request on each the same text). A controller trace goes to a file of its own,
    the replica's id before the suffix (`trace.jsonl` -> `trace.<replica>.jsonl`): every replica runs its own
    controller, and one file opened by each would be truncated and overwritten by the others, as would a dead
    replica's by its replacement."""
    seed = engine.get("seed", EngineConfig.model_fields["seed"].default)  # an int: checked when the app was built
    options = {**engine, "seed": seed + rank}
    trace = engine.get("trace_path")
    if trace is None:
        return options
    path = Path(trace)
    tag = re.sub(r"[^\w.-]", "-", replica)  # a file name's characters
    return {**options, "trace_path": str(path.with_name(f"{path.stem}.{tag}{path.suffix}"))}


@serve.ingress()
class LoopedSpecServer:
    """One replica: its own engine and async front, the single-process FastAPI app around them."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args = parse_args(args)
        configure_logging(args.log_level)  # before the engine starts: its startup lines (preset, KV cache) at info
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        context = serve.get_replica_context()
        self.replica = context.replica_tag
        self.app_name, self.deployment_name = context.app_name, context.deployment
        engine = LoopedSpecEngine(args.model, **replica_engine_options(args.engine, self.replica, context.rank.rank))
        self.engine = AsyncLoopedSpecEngine(engine, max_queued=args.max_queued)
        self.metrics_port = args.metrics_port + context.rank.local_rank if args.metrics_port is not None else None
        self.metrics_server = None

    def __serve_build_asgi_app__(self):
        args = self.args
        api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
        name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
        app = build_app(self.engine, name, api_key, args.max_body_bytes, replica=self.replica,
                        readiness=lambda: deployment_readiness(self.app_name, self.deployment_name),
                        tool_calling=args.tool_calling, chat_template=args.chat_template,
                        reasoning_parser=args.reasoning_parser,
                        return_tokens_as_token_ids=args.return_tokens_as_token_ids)  # fmt: skip
        if self.metrics_port is not None:
            self.metrics_server, _ = start_http_server(self.metrics_port, registry=app.state.metrics_registry)
        return app

    def check_health(self) -> None:
        """Ray's periodic health check: a replica whose engine worker stopped is replaced."""
        if not self.engine.is_running:
            raise RuntimeError(f"replica {self.replica}: engine worker stopped")

    def __del__(self) -> None:
        server = getattr(self, "metrics_server", None)  # unset when the constructor failed
        if server is not None:
            server.shutdown()


async def deployment_readiness(app_name: str, deployment_name: str) -> str | None:
    """Why the deployment is not serving at full strength yet (None once every replica it wants is running)."""
    status = await asyncio.to_thread(serve.status)
    app = status.applications.get(app_name)
    if app is None or deployment_name not in app.deployments:
        return f"deployment {app_name}/{deployment_name} not found"
    deployment = app.deployments[deployment_name]
    # scaling down, it still runs every replica it wants (and some it is stopping): at full strength
    if deployment.status not in ("HEALTHY", "DOWNSCALING"):
        running = deployment.replica_states.get("RUNNING", 0)
        return f"deployment {deployment.status.lower()} ({running} replicas running)"
    return None


def build_application(args: dict[str, Any] | ReplicaAppArgs) -> serve.Application:
    """The Serve application (the `import_path` of a Serve config file or KubeRay RayService)."""
    args = parse_args(args)
    config = args.engine_config()
    options: dict[str, Any] = {
        # a replica is sent its batch; waiting requests wait in Ray's queue, where any replica that frees a place takes
        # the next, and beyond `max_queued` of them Ray answers 429 with Retry-After, as the single server does
        "max_ongoing_requests": config.max_batch_size,
        "max_queued_requests": args.max_queued,
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=float(RETRY_AFTER_S)),
        "ray_actor_options": {"num_cpus": max(args.threads, 1), "num_gpus": _gpus_per_replica(args, config)},
    }
    if args.max_replicas is not None:
        min_replicas = args.min_replicas if args.min_replicas is not None else 1
        autoscaling = {"min_replicas": min_replicas, "max_replicas": args.max_replicas}
        if args.target_ongoing_requests is not None:
            autoscaling["target_ongoing_requests"] = args.target_ongoing_requests
        options["autoscaling_config"] = AutoscalingConfig(**autoscaling)
    else:
        options["num_replicas"] = args.num_replicas or 1
    deployment = serve.deployment(LoopedSpecServer, name=DEPLOYMENT_NAME, **options)
    return deployment.bind(args.model_dump())


def _gpus_per_replica(args: ReplicaAppArgs, config: EngineConfig) -> float:
    if args.num_gpus is not None:
        return args.num_gpus
    device = str(config.device)
    if device.startswith("cuda"):
        return 1
    if device == "auto" and ray.is_initialized():
        return 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    return 0


def run_replicas(args: ReplicaAppArgs, host: str, port: int) -> None:
    """Start (or join, with RAY_ADDRESS) a Ray cluster, serve the application on host:port until interrupted."""
    application_args = parse_args(args)
    application_args.check_before_start()  # a bad option, model or preset fails here, before Ray starts
    address = os.environ.get("RAY_ADDRESS")
    ray.init(address=address, include_dashboard=False, log_to_driver=True)
    # SIGTERM ends the server like Ctrl-C (after ray.init, which installs its own handler): the application is
    # deleted and a local cluster this process started is shut down with it
    signal.signal(signal.SIGTERM, _interrupt)
    # Serve already running (a cluster joined, through RAY_ADDRESS or found on this machine) is not this process's
    running = serve.context._get_global_client(raise_if_no_controller_running=False)
    owns_serve, deployed = address is None and running is None, False
    try:
        if running is not None:
            _check_proxy_address(running.http_config, host, port)
        serve.start(http_options={"host": host, "port": port})
        deployed = True
        serve.run(build_application(application_args), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"looped-spec: serving on http://{host}:{port} through Ray Serve", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        if owns_serve:  # the local cluster this process started: Serve and Ray go with it
            serve.shutdown()
        elif deployed:  # a cluster it joined (others' applications may run on it): only this application goes
            serve.delete(APP_NAME)
        ray.shutdown()


class ProxyAddressError(ValueError):
    """The Serve already running on the cluster joined listens elsewhere than --host / --port."""


def _check_proxy_address(http: Any, host: str, port: int) -> None:
    """Serve's HTTP proxies belong to the cluster: where Serve already runs, `serve.start` keeps their host and port
    and only logs that ours were ignored. Refuse rather than announce an address nothing listens on."""
    if (http.host, http.port) != (host, port):
        raise ProxyAddressError(
            f"--host {host} --port {port}: the Ray cluster joined already runs Serve, whose HTTP proxies listen on "
            f"{http.host}:{http.port} (Serve's HTTP options are the cluster's and stay while it runs); pass --host "
            f"{http.host} --port {http.port}, or stop Serve there first (`serve shutdown`)"
        )


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
