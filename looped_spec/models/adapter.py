"""ModelAdapter: the only place that knows a model family, and the family registry.

A looped model is run in stages so the engine can stop after any loop:

    state = embed(token_ids, ctx)            # state before loop 1
    state = loop(state, i, ctx)  for i in 0..depth-1
    logits = readout(state, depth, ctx)      # logits after `depth` loops

The state is always one tensor `[num_tokens, state_dim]` (families that carry
more than a hidden vector, such as Huginn's injected prelude output, pack it in
there), so the engine can slice, stack and cache it without knowing the family.
"""

from __future__ import annotations

import difflib
import inspect
import logging
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch

from looped_spec.models.checkpoint import (
    CheckpointError,
    TensorSpec,
    check_tensors,
    read_config,
    read_tensors,
    resolve_device,
    resolve_dtype,
)
from looped_spec.models.config_fields import token_ids_field
from looped_spec.models.dense import DenseContext
from looped_spec.models.generation_config import GenerationConfig, read_generation_config
from looped_spec.models.kv_layout import KVLayout

logger = logging.getLogger(__name__)


class ModelAdapter(ABC):
    """Family-specific math and weights behind a family-neutral staged interface.

    Subclasses set `model_type` (the `config.json` value they serve), describe their tensors in
    `tensor_specs`, validate config values in `check_config`, and implement `embed`, `loop` and
    `readout`. Register them with `register_adapter`.
    """

    model_type: ClassVar[str] = ""
    #: True when `readout` attends over cached keys (Huginn's coda): every cached position must then be
    #: read out, and a readout writes its plane's KV.
    readout_uses_kv: ClassVar[bool] = False
    #: True when `embed` reads its context (attends, as Huginn's prelude does, or draws per-token seeds); False lets
    #: a loop pass embed the tokens entering it without a context of their own (loop_batching/batcher.py)
    embed_uses_context: ClassVar[bool] = True
    #: True when `loop(state, i)` is `loop(state, 0)` with every plane moved by i * (loop planes / depth),
    #: and `readout(state, depth)` does not depend on depth: one CUDA graph of loop 0 then serves every loop, and
    #: tokens that exited at different depths are read out in one call (early_exit.py `read_out_by_depth`).
    uniform_loops: ClassVar[bool] = False
    #: The adapter options the family takes (`load_adapter(..., **options)`, the engine's `adapter_options`, the
    #: CLI's `--adapter-option`): any other name is an error naming it. The family reads them from `self.options`.
    option_names: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        config: dict,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        name: str | None = None,
        path: str | None = None,
        **options: Any,
    ) -> None:
        self.config = config
        # the checkpoint's own model_type: a family registered under several names is each of them by its checkpoint
        if isinstance(config.get("model_type"), str):
            self.model_type = config["model_type"]
        self.dtype = dtype
        self.device = torch.device(device)
        self.name = name or config.get("_name_or_path") or self.model_type
        self.path = path
        self.options = self.checked_options(options, config)
        self.generation = GenerationConfig()  # load_adapter sets the checkpoint's generation_config.json
        self.weights = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items()}

    @classmethod
    def check_option_names(cls, options: Iterable[str], model_type: str | None = None) -> None:
        """A ValueError naming each of `options` the family does not take, with the name it likely meant. Needs no
        checkpoint: Ray Serve's driver asks it before any replica loads the model."""
        unknown = sorted(set(options) - set(cls.option_names))
        if unknown:
            # "adapter option ..." first: the command line names the flag that set it (--adapter-option)
            close = [difflib.get_close_matches(name, cls.option_names, n=1) for name in unknown]
            meant = [
                f"{c[0]!r}" + (f" instead of {name!r}" if len(unknown) > 1 else "")
                for name, c in zip(unknown, close)
                if c
            ]
            hints = f" (did you mean {' and '.join(meant)}?)" if meant else ""
            raise ValueError(
                f"adapter option {', '.join(unknown)}: not an option of {model_type or cls.model_type}{hints}; it "
                f"takes: {', '.join(cls.option_names) or 'none'}"
            )

    @classmethod
    def checked_options(cls, options: dict[str, Any], config: dict) -> dict[str, Any]:
        """`options` as the family reads them from `self.options`, each name and value checked against `config`
        (config.json): a ValueError naming the option. Needs no weights, so Ray Serve's driver asks it before any
        replica loads the model. A family with options overrides it (super() first: it checks the names)."""
        cls.check_option_names(options, config.get("model_type") if isinstance(config.get("model_type"), str) else None)
        return dict(options)

    # ----- description -----
    @classmethod
    @abstractmethod
    def tensor_specs(cls, config: dict) -> dict[str, TensorSpec]:
        """Every tensor the checkpoint may hold, with its expected shape."""

    @classmethod
    def check_config(cls, config: dict) -> None:
        """Raise ValueError naming the field for config values this implementation does not support."""
        return None

    @property
    @abstractmethod
    def full_depth(self) -> int:
        """D: the number of loop iterations of a full-depth forward."""

    @property
    def max_dense_depth(self) -> int:
        """Largest depth `dense_logits` accepts (D unless the family can run longer)."""
        return self.full_depth

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def state_dim(self) -> int: ...

    @property
    @abstractmethod
    def kv_layout(self) -> KVLayout: ...

    @property
    def max_positions(self) -> int:
        """Longest sequence the model supports (prompt + generated)."""
        return int(self.config.get("max_position_embeddings", 4096))

    @property
    def eos_token_ids(self) -> list[int]:
        """config.json's eos_token_id plus generation_config.json's (HF and vLLM stop on both)."""
        ids = token_ids_field(self.config.get("eos_token_id"), "eos_token_id") + self.generation.stop_token_ids()
        return list(dict.fromkeys(ids))

    @property
    def needs_token_seeds(self) -> bool:
        """True when `embed` draws per-token random values keyed by (request seed, position)."""
        return False

    # ----- staged execution -----
    @abstractmethod
    def embed(self, token_ids: torch.Tensor, ctx) -> torch.Tensor:
        """token_ids [num_tokens] -> state before loop 1 [num_tokens, state_dim]."""

    @abstractmethod
    def loop(self, state: torch.Tensor, loop_index: int, ctx) -> torch.Tensor:
        """One recurrent iteration (0-based `loop_index`), reading and writing that loop's KV."""

    @abstractmethod
    def readout(self, state: torch.Tensor, depth: int, ctx) -> torch.Tensor:
        """Logits [num_tokens, vocab] in fp32 from the state after `depth` loops."""

    def readout_hidden(self, state: torch.Tensor, depth: int, ctx) -> torch.Tensor | None:
        """The readout up to its vocabulary projection ([num_tokens, hidden]), for a family whose `head` maps rows of
        it to `readout`'s logits: scoring a sequence (`dense_logit_chunks`) then projects a chunk of positions at a
        time instead of holding every position's logits ([T, vocab] fp32: gigabytes for a long prompt and a large
        vocabulary). None (the default): the family does not split its readout, and scoring holds them all."""
        return None

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of `readout_hidden` -> logits [rows, vocab] fp32 (a family whose `readout_hidden` is not None)."""
        raise NotImplementedError(f"{self.model_type} does not split its readout (readout_hidden returns None)")

    def exit_signal(self, state: torch.Tensor, depth: int, prev_state: torch.Tensor | None = None):
        """Family exit signal after `depth` loops ([num_tokens] fp32), or None when the family has none."""
        return None

    # ----- early exit (docs/architecture.md, "Early exit") -----
    #: True when the family has an exit rule driven by `exit_threshold` (Ouro's gate, Huginn's convergence).
    has_exit_rule: ClassVar[bool] = False
    #: the largest `exit_threshold` the rule reads (Ouro's is a cumulative exit probability: at most 1); None: no bound
    max_exit_threshold: ClassVar[float | None] = None
    #: where `default_exit_threshold` comes from, as error messages name it
    default_exit_threshold_source: ClassVar[str] = "default exit_threshold"

    @property
    def default_exit_threshold(self) -> float | None:
        """The threshold a request gets when it sets none (Ouro: config early_exit_threshold); None = no rule."""
        return None

    def exit_rule_can_fire(self, threshold: float) -> bool:
        """False when `threshold` never exits before D (then the plain full-depth path is used)."""
        return True

    @property
    def exit_rule_reads_kv(self) -> bool:
        """True when `exit_rule` reads out through attention (Huginn's "kl"): its decision for a token then
        depends on the readout KV of the tokens before it, final only once they exited, so a speculative round
        cannot decide several positions of a request in one pass; the engine gives such requests K = 0."""
        return False

    #: False when `exit_rule` does not depend on its `depth` argument (Ouro's gate, Huginn's latent change): a loop
    #: pass then decides rows at different depths in one call (loop_batching/batcher.py)
    exit_rule_uses_depth: ClassVar[bool] = True

    def exit_carry(self, num_rows: int) -> torch.Tensor | None:
        """What the exit rule carries from loop to loop, one row per token ([num_rows, ...]), or None."""
        return None

    def exit_rule(
        self,
        state: torch.Tensor,
        depth: int,
        prev_state: torch.Tensor,
        carry: torch.Tensor | None,
        threshold: torch.Tensor,
        ctx,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """After loop `depth` (< D): which tokens exit ([num_rows] bool, per-row `threshold` [num_rows]), the new
        carry, and the logits [num_rows, V] of `readout(state, depth, ctx)` when the rule read them out (else None).
        `prev_state` is the state before the loop. A rule that reads out writes the readout's KV (Huginn's coda): in
        skip mode a token that exits here leaves with that KV and those logits, which the engine uses as its readout;
        in select mode it loops on, and the runner reads out again at the exit depth last, so that write wins."""
        raise NotImplementedError(f"{self.model_type} has no exit rule; use exit_at_step")

    def loop_planes(self, loop_index: int) -> range:
        """KV planes written by loop `loop_index` (0-based)."""
        layout = self.kv_layout
        per_loop = layout.num_loop_planes // self.full_depth
        start = layout.first_loop_plane + loop_index * per_loop
        return range(start, start + per_loop)

    # ----- reference path -----
    @torch.no_grad()
    def dense_logits(
        self,
        input_ids: torch.Tensor,
        depth: int | None = None,
        initial_state: torch.Tensor | None = None,
        seeds: list[int] | None = None,
    ) -> torch.Tensor:
        """Cache-free forward of [B, T] (or [T]) token ids at `depth` loops -> logits [B, T, V] fp32."""
        state, ctx, depth = self._dense_state(input_ids, depth, initial_state, seeds)
        return self.readout(state, depth, ctx).view(ctx.batch_size, ctx.seq_len, -1)

    @torch.no_grad()
    def dense_logit_chunks(self, input_ids: torch.Tensor, rows: int, seeds: list[int] | None = None):
        """The full-depth logits of a cache-free forward of one sequence [T], `rows` positions at a time (an iterator
        of [<= rows, V] fp32, in order): a family that splits its readout (`readout_hidden`) never holds more than
        `rows` positions' logits; another's are computed at once and handed out in slices."""
        state, ctx, depth = self._dense_state(input_ids, None, None, seeds)
        if ctx.batch_size != 1:
            raise ValueError(f"dense_logit_chunks takes one sequence; got {ctx.batch_size}")
        hidden = self.readout_hidden(state, depth, ctx)
        if hidden is None:
            yield from self.readout(state, depth, ctx).split(rows)
            return
        del state  # only the hidden rows are needed from here
        for part in hidden.split(rows):
            yield self.head(part)

    def _dense_state(
        self, input_ids: torch.Tensor, depth: int | None, initial_state: torch.Tensor | None, seeds: list[int] | None
    ) -> tuple[torch.Tensor, DenseContext, int]:
        """The state after `depth` loops (None: full depth) of a cache-free forward, its context and the depth."""
        depth = self.full_depth if depth is None else depth
        if not 1 <= depth <= self.max_dense_depth:
            raise ValueError(f"depth {depth} outside 1..{self.max_dense_depth} for {self.model_type}")
        ids = torch.as_tensor(input_ids, device=self.device)
        if ids.dim() == 1:
            ids = ids[None]
        batch, seq = ids.shape
        positions = torch.arange(seq, device=self.device).repeat(batch)
        ctx = DenseContext(batch, seq, positions, seeds=seeds)
        state = self.embed(ids.reshape(-1), ctx)
        if initial_state is not None:
            state = self.with_initial_state(state, initial_state.reshape(batch * seq, -1))
        for i in range(depth):
            state = self.loop(state, i, ctx)
        return state, ctx, depth

    def with_initial_state(self, state: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
        """Replace the latent initial state (families with one); others reject it."""
        raise ValueError(f"{self.model_type} has no latent initial state to set")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, depth={self.full_depth}, dtype={self.dtype})"


# ----- registry -----
_REGISTRY: dict[str, type[ModelAdapter]] = {}


def register_adapter(cls_or_type: type[ModelAdapter] | str | None = None, *, model_type: str | None = None):
    """Register an adapter class for its `model_type` (decorator or plain call).

    `@register_adapter` uses the class attribute `model_type`; `@register_adapter("my_type")` or
    `register_adapter(MyAdapter, model_type="my_type")` name it explicitly.
    """

    def apply(cls: type[ModelAdapter], key: str | None) -> type[ModelAdapter]:
        if not (isinstance(cls, type) and issubclass(cls, ModelAdapter)):
            raise TypeError(f"{cls!r} is not a ModelAdapter subclass")
        if inspect.isabstract(cls):  # else loading failed later: without tensor_specs, on a bare AttributeError
            missing = ", ".join(sorted(cls.__abstractmethods__))
            raise TypeError(f"{cls.__name__} does not implement {missing}, which a ModelAdapter must provide")
        key = key or cls.model_type
        if not key:
            raise ValueError(f"{cls.__name__} has no model_type to register under")
        # the built-in families register when first needed (a checkpoint loaded): first, so that they never replace
        # a family registered here for one of their model types (re-entered while they register: a no-op)
        _load_builtin_adapters()
        replaced = _REGISTRY.get(key)
        if replaced is not None and replaced is not cls:
            logger.warning("model_type %r: %s replaces %s.%s", key, cls.__name__, replaced.__module__,
                           replaced.__name__)  # fmt: skip
        if not cls.model_type:  # a class registered under a second name keeps its first (its instances: the config's)
            cls.model_type = key
        _REGISTRY[key] = cls
        return cls

    if isinstance(cls_or_type, type):
        return apply(cls_or_type, model_type)
    key = cls_or_type if isinstance(cls_or_type, str) else model_type

    def decorator(cls: type[ModelAdapter]) -> type[ModelAdapter]:
        return apply(cls, key)

    return decorator


def registered_model_types() -> list[str]:
    """The model types a checkpoint may have: the families registered in this process and those installed packages
    provide (`ENTRY_POINT_GROUP`, loaded when a checkpoint asks for one)."""
    from importlib.metadata import entry_points

    _load_builtin_adapters()
    return sorted(set(_REGISTRY) | {e.name for e in entry_points(group=ENTRY_POINT_GROUP)})


def _load_builtin_adapters() -> None:
    import looped_spec.adapters  # noqa: F401  (registers the built-in families)


#: The entry-point group through which an installed package provides families: `name = "module:Class"` with name the
#: config.json model_type (or `name = "module"`, a module that registers its families when imported). Every process
#: that loads a checkpoint finds them there: the CLI, the server and each Ray Serve replica.
ENTRY_POINT_GROUP = "looped_spec.adapters"


def _load_entry_point(model_type: str) -> None:
    """Register the family an installed package provides for `model_type` (see `ENTRY_POINT_GROUP`), if one does."""
    from importlib.metadata import entry_points

    entries = list(entry_points(group=ENTRY_POINT_GROUP, name=model_type))
    if len(entries) > 1:
        # the distribution an entry point came from (importlib.metadata gives it): the name to uninstall
        packages = [getattr(getattr(e, "dist", None), "name", None) for e in entries]
        listed = ", ".join(repr(e.value) + (f" (package {p})" if p else "") for e, p in zip(entries, packages))
        which = f" of the packages {', '.join(dict.fromkeys(p for p in packages if p))}" if any(packages) else ""
        raise CheckpointError(
            f"model_type {model_type!r}: several installed packages provide it (entry points {listed} in group "
            f"{ENTRY_POINT_GROUP!r}); uninstall all but one{which}"
        )
    for entry in entries:
        try:
            provided = entry.load()
        except Exception as exc:
            raise CheckpointError(
                f"entry point {entry.name} = {entry.value!r} (group {ENTRY_POINT_GROUP!r}): loading it failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if isinstance(provided, type) and issubclass(provided, ModelAdapter):
            if provided.model_type not in ("", model_type):
                raise CheckpointError(
                    f"entry point {entry.name} = {entry.value!r} (group {ENTRY_POINT_GROUP!r}) names a class whose "
                    f"model_type is {provided.model_type!r}: the entry point's name must be its model_type"
                )
            register_adapter(provided, model_type=model_type)
        if model_type not in _REGISTRY:
            raise CheckpointError(
                f"entry point {entry.name} = {entry.value!r} (group {ENTRY_POINT_GROUP!r}) registered no adapter for "
                f"model_type {model_type!r}: point it at the ModelAdapter subclass, or at a module that registers it"
            )
        return


def found_by_every_process(model_type: str) -> bool:
    """Whether a new process finds the family of `model_type` (built in, or an installed entry point) rather than only
    this one, which registered it (what Ray Serve replicas, each a process of its own, need)."""
    from importlib.metadata import entry_points

    _load_builtin_adapters()
    cls = _REGISTRY.get(model_type)
    built_in = cls is not None and cls.__module__.startswith("looped_spec.adapters")
    return built_in or bool(entry_points(group=ENTRY_POINT_GROUP, name=model_type))


def adapter_class(model_type: str, where: str = "config.json") -> type[ModelAdapter]:
    """The adapter registered for `model_type`: a built-in family, one registered in this process, or one an installed
    package provides through the `looped_spec.adapters` entry-point group."""
    _load_builtin_adapters()
    if model_type not in _REGISTRY:
        _load_entry_point(model_type)
    if model_type not in _REGISTRY:
        raise CheckpointError(
            f"{where}: unknown model_type {model_type!r}; registered: {', '.join(registered_model_types())}. A new "
            "family is a ModelAdapter subclass: register it with looped_spec.register_adapter in this process, or "
            f"install a package that names it under the entry-point group {ENTRY_POINT_GROUP!r} (how the CLI, the "
            "server and Ray Serve replicas find it; docs/architecture.md, 'Adding a family')"
        )
    return _REGISTRY[model_type]


def resolve_model_path(path_or_name: str | Path) -> Path:
    """A folder path, or the short name of a model shipped with looped-spec (e.g. 'tiny-ouro')."""
    path = Path(path_or_name)
    if path.is_dir():
        return path
    from looped_spec.models import shipped_model_path, shipped_models

    shipped = shipped_model_path(str(path_or_name))
    if shipped is not None:
        return shipped
    raise CheckpointError(
        f"{path_or_name}: not a checkpoint folder nor a shipped model name (shipped: {', '.join(shipped_models())})"
    )


def load_adapter(
    path_or_name: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    **options: Any,
) -> ModelAdapter:
    """Load a checkpoint folder (or shipped model name) with the adapter registered for its model_type."""
    folder = resolve_model_path(path_or_name)
    config = read_config(folder)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise CheckpointError(f"{folder / 'config.json'}: no model_type field")
    config_path = folder / "config.json"
    cls = adapter_class(model_type, str(config_path))
    try:
        cls.check_config(config)
        token_ids_field(config.get("eos_token_id"), "eos_token_id")
        specs = cls.tensor_specs(config)
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        raise _config_error(config_path, exc) from exc
    generation = read_generation_config(folder)
    dtype, device = resolve_dtype(dtype, config, str(config_path)), resolve_device(device)
    tensors, origin = read_tensors(folder)
    weights = check_tensors(tensors, specs, origin, folder)
    try:
        adapter = cls(config, weights, dtype=dtype, device=device, name=folder.name, path=str(folder), **options)
        _read_declarations(adapter)
    except KeyError as exc:  # a field the family reads when built or asked its depth, and the file lacks
        if missing_config_field(exc, config, specs, cls.option_names) is None:  # not a config field: the family's own
            raise
        raise _config_error(config_path, exc) from exc
    adapter.generation = generation
    _check_eos_in_vocabulary(adapter, folder)
    return adapter


def describe_adapter(path_or_name: str | Path, **options: Any) -> ModelAdapter | None:
    """The family built on weightless ("meta") tensors shaped as its `tensor_specs`: its description (depth, positions,
    vocabulary, name, path) for checks that need no weights, as Ray Serve's driver makes before any replica loads the
    model. None when the family cannot be built so (its `__init__` computes on its weights): the replicas check then."""
    folder = resolve_model_path(path_or_name)
    config = read_config(folder)
    config_path = folder / "config.json"
    cls = adapter_class(str(config.get("model_type")), str(config_path))
    try:
        specs = cls.tensor_specs(config)
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        raise _config_error(config_path, exc) from exc
    weights = {name: torch.empty(spec.shape, device="meta") for name, spec in specs.items() if not spec.optional}
    try:
        adapter = cls(config, weights, device="meta", name=folder.name, path=str(folder), **options)
        _read_declarations(adapter)
    except (ValueError, CheckpointError):
        raise  # the family's own error about its config or options: the same in every replica
    except KeyError as exc:
        if missing_config_field(exc, config, specs, cls.option_names) is not None:  # as loading names it
            raise _config_error(config_path, exc) from exc
        return _not_described(folder)
    except Exception:  # noqa: BLE001 - a family computing on its weights at construction: not describable so
        return _not_described(folder)
    return adapter


def _not_described(folder: Path) -> None:
    logger.info("%s: the family cannot be built without its weights; the replicas check the options that depend on "
                "the model", folder)  # fmt: skip


def _check_eos_in_vocabulary(adapter: ModelAdapter, folder: Path) -> None:
    """An eos token past the model's vocabulary can never be generated, and a request with min_tokens (which masks the
    eos tokens' logits) failed on it with a bare IndexError: an error naming the file and field at load instead."""
    for path, ids in (
        (folder / "config.json", token_ids_field(adapter.config.get("eos_token_id"), "eos_token_id")),
        (folder / "generation_config.json", adapter.generation.stop_token_ids()),
    ):
        outside = next((token for token in ids if token >= adapter.vocab_size), None)
        if outside is not None:
            raise CheckpointError(
                f"{path}: eos_token_id {outside} is outside the model's vocabulary [0, {adapter.vocab_size})"
            )


def missing_config_field(exc: KeyError, config: dict, specs: Collection[str], options: Collection[str]) -> str | None:
    """The config.json field a family's KeyError names when the file lacks it (a family that indexes `config["..."]`,
    as examples/custom_family.py does); None for any other key: one the file has, a tensor name (an optional tensor
    left out) or an option of the family (`self.options[...]`)."""
    key = exc.args[0] if len(exc.args) == 1 else None
    if not isinstance(key, str) or key in config or key in specs or key in options:
        return None
    return key


def _config_error(config_path: Path, exc: Exception) -> CheckpointError:
    """A family's error about its config as one naming the file. A KeyError is a field the family reads and the file
    lacks (a family that indexes `config["..."]`, as examples/custom_family.py does): its message is only the key."""
    if isinstance(exc, KeyError) and exc.args:
        return CheckpointError(f"{config_path}: missing field {exc.args[0]}")
    return CheckpointError(f"{config_path}: {exc}")


def _read_declarations(adapter: ModelAdapter) -> None:
    """Read what the family derives from its config, so that a field it lacks fails here, naming config.json, and
    not as a bare KeyError wherever the engine first asks (the depth, the KV layout, ...)."""
    for name in ("full_depth", "vocab_size", "state_dim", "kv_layout", "max_positions"):
        getattr(adapter, name)
