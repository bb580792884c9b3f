"""Typed, validated arguments of the Serve application (``deployments.app:build_app``).

Pure (no Ray). :class:`AppArgs` / :class:`DeploymentSpec` (pydantic): field-level validation of
what a user writes on the ``serve run`` command line or under ``args:`` in a Serve config.
Top-level deployment fields are the defaults of every entry of ``deployments:``; without a
``deployments:`` list they describe the one deployment of the app. The checks that need the
checkpoint's ``config.json`` are in :mod:`deployments.config.resolve`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moe_runtime.planning.budget import DEFAULT_MEMORY_FRACTION, MI300X_MEMORY_GB
from moe_runtime.tp.plan import check_sequence_parallel_tail
from moe_runtime.units import SERVED_DTYPES, check_mxfp4_scale_rule

from .timeouts import MAX_LINGER_S, MAX_SESSIONS, SESSION_LINGER_S, Bounds, check_order, request_bound

Tail = Literal["auto", "sharded", "replicated", "overlap", "single_allreduce"]
DType = Literal[SERVED_DTYPES]
Accelerator = Literal["auto", "gpu", "cpu"]
# Relative ``cluster_config`` paths are resolved against the repository root (the directory that
# holds ``deployments/``: ``~/latent-moe-serve`` on cluster nodes), never against the working
# directory, which differs between ``serve run`` and the task in which Serve builds the app.
PROJECT_ROOT = Path(__file__).resolve().parents[2]
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}$")
DEFAULT_DEPLOYMENT = "moe"
RAY_METRICS_INTERVAL_S = 10.0  # Ray Serve's default AutoscalingConfig.metrics_interval_s


class AutoscalingSpec(BaseModel):
    """Replica bounds and targets; turned into Ray's ``autoscaling_config`` by ``options.py``.

    ``token_aware`` uses the token-based policy of ``deployments.control.autoscaling`` (replicas report
    queued tokens and tokens/s); otherwise Ray's request-count policy with
    ``target_ongoing_requests``. ``cluster_config``: a cluster-launcher YAML whose MI300X
    capacity caps ``max_replicas`` (GPUs / tp_size, counting nodes the launcher may add), shared
    by all deployments of the app that name it; absolute, or relative to the repository root.
    """

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(8.0, gt=0)
    token_aware: bool = True
    target_queued_tokens_per_replica: float = Field(8192.0, gt=0)
    target_tokens_per_s_per_replica: float | None = Field(None, gt=0)
    upscale_delay_s: float = Field(0.0, ge=0)
    downscale_delay_s: float = Field(300.0, ge=0)
    # Ray's windows: replicas push metrics every metrics_interval_s (None: Ray's default, 10 s);
    # the policy sees them aggregated over look_back_period_s, which must span several pushes.
    look_back_period_s: float = Field(30.0, gt=0)
    metrics_interval_s: float | None = Field(None, gt=0)
    cluster_config: str | None = None

    @field_validator("cluster_config")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is None:
            return v
        path = Path(v).expanduser()
        path = path if path.is_absolute() else PROJECT_ROOT / path
        if not path.is_file():
            raise ValueError(
                f"cluster_config {v!r}: no file at {path} (relative paths are resolved against the "
                f"repository root {PROJECT_ROOT}, not the working directory; give an absolute path otherwise)"
            )
        return str(path)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} < min_replicas {self.min_replicas}")
        interval = self.metrics_interval_s if self.metrics_interval_s is not None else RAY_METRICS_INTERVAL_S
        if self.look_back_period_s <= interval:
            raise ValueError(
                f"look_back_period_s {self.look_back_period_s} must exceed the metrics push interval "
                f"{interval} (metrics_interval_s)"
            )
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError(
                f"initial_replicas {self.initial_replicas} is outside "
                f"[min_replicas {self.min_replicas}, max_replicas {self.max_replicas}]"
            )
        return self


class DeploymentSpec(BaseModel):
    """One TP-group deployment: which layers, how they are sharded, batched and scaled."""

    model_config = ConfigDict(extra="forbid")

    name: str = DEFAULT_DEPLOYMENT
    role: str | None = None  # informational (e.g. "prefill", "decode"); shown in status()
    tp_size: int = Field(1, ge=1)
    tail: Tail = "auto"
    sequence_parallel: bool = False
    preshard_up_proj: bool = False
    layers: list[int] | None = None  # None: every MoE layer of the checkpoint
    dtype: DType = "float32"
    backend: str = "torch"  # experts backend: torch | aiter | auto
    # mxfp4: W4A4 emulation of MXFP4 experts (h and the gated activation quantised to MXFP4,
    # what the ROCm production experts do); needs an MXFP4 checkpoint. none: W4A16.
    experts_activation_quant: Literal["none", "mxfp4"] = "none"
    # Block exponent of the MXFP4 activations: even (AMD Quark's default, as vLLM's emulation and
    # aiter's Triton quantiser round) or floor (plain OCP, for comparison; needs W4A4 experts).
    mxfp4_scale_rule: Literal["even", "floor"] = "even"
    max_batch_tokens: int = Field(2048, ge=1)
    max_tokens_per_request: int = Field(8192, ge=1)
    batch_wait_timeout_s: float = Field(0.002, ge=0, le=1.0)
    collective_timeout_s: float = Field(60.0, gt=0)
    # How long a TP-group call may run beyond the collective timeout (the forward's compute).
    call_margin_s: float = Field(30.0, gt=0)
    # tail "auto" with several legal tails at TP > 1: the controller times each on the group at
    # warm-up at these token counts and keeps the fastest per range (deployments.serve.tuning.tune_group);
    # [] turns the measurement off (auto is then the static rule: sharded when legal).
    auto_tune_tokens: list[int] = Field(default_factory=lambda: [1, 16, 128, 1024])
    auto_tune_reps: int = Field(3, ge=1)
    # The measurement's clock, "module:callable" in the project's own tests package only: a test
    # scripts the timings; an app config must not make the workers import code of its choosing.
    tune_clock: str | None = None
    # The warm-up measurement's time limit: the token counts whose measurement the planner's
    # cost model estimates within it are timed (ascending), the rule-based tail serves above the
    # largest one; measuring also stops once this much time has passed. A measured plan is
    # stored cluster-wide under a key of what determines it (checkpoint, layers, TP size,
    # dtype, device, backend, code) and reused by every later replica with the same key;
    # remeasure_tail: true measures anew and replaces it.
    warmup_limit_s: float = Field(120.0, gt=0)
    remeasure_tail: bool = False
    # Workers start, join the group and load their shards within this bound (replica start).
    # None: derived at build time from the memory planner's bytes
    # (moe_runtime.planning.cost.startup_timeout_s).
    startup_timeout_s: float | None = Field(None, gt=0)
    # Memory (DESIGN §8): each rank's layers + workspace must fit device_memory_gb (per GPU,
    # GB = 1e9 B) x memory_fraction, or on CPU the node's memory x memory_fraction / tp_size;
    # checked at build time. experts_format: "auto" reads it from the checkpoint's tensor names;
    # a config-only checkpoint needs it stated to be checked.
    device_memory_gb: float = Field(MI300X_MEMORY_GB, gt=0)
    memory_fraction: float = Field(DEFAULT_MEMORY_FRACTION, gt=0, le=1)
    experts_format: Literal["auto", "mxfp4", "dense"] = "auto"
    num_replicas: int | None = Field(None, ge=1)
    autoscaling: AutoscalingSpec | None = None
    max_ongoing_requests: int = Field(64, ge=1)
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float | None = Field(None, gt=0)
    graceful_shutdown_timeout_s: float = Field(5.0, ge=0)
    replica_cpus: float = Field(1.0, gt=0)  # bundle 0: the replica itself
    # Where the ranks run. gpu: one {"GPU": 1} bundle per rank, NCCL/RCCL (logical GPUs on a CPU
    # machine run on CPU with gloo). cpu: one {"CPU": worker_cpus} bundle per rank, gloo.
    # auto: gpu when the Ray cluster has GPUs or its launcher can add a node type with GPUs,
    # else cpu; decided and logged once at build time (deployments.control.accelerator).
    accelerator: Accelerator = "auto"
    # Ray CPUs each rank reserves: None = 0 beside a GPU, 0.25 on CPU bundles (a scheduling
    # token so that a small machine holds a TP group; a rank's torch threads come from the
    # node's cores, moe_runtime.tp.collectives.threads_per_rank).
    worker_cpus: float | None = Field(None, gt=0)
    accelerator_type: str | None = None  # e.g. "AMD-Instinct-MI300X-OAM": pins workers to it
    # CPU-only serving, where ranks and the request path share cores: run the ranks this much
    # nicer than the replica, so the replica's event loop keeps receiving requests (and
    # forming the next batch) while the ranks compute. Ignored on GPUs.
    worker_nice_increment: int = Field(0, ge=0, le=19)
    # Sessions (lanes, cohorts, independent peers: deployments.client): a client opens a session
    # on a replica's TP group and its peers send their rows to the ranks over the data plane
    # (deployments.dataplane). A group serves every open session and the Serve path at once; a
    # session has no term: it ends when its opener closes it, or once none of its peers has
    # been connected for session_linger_s (the opener may set its own). At most max_sessions
    # sessions are open on one group at once. lanes: false refuses every session (the Serve
    # path only).
    lanes: bool = True
    session_linger_s: float = Field(SESSION_LINGER_S, gt=0, le=MAX_LINGER_S)
    max_sessions: int = Field(MAX_SESSIONS, ge=1, le=4096)
    # Bounded queue: past this many requests waiting for a replica, a call is refused at once
    # (handle: BackPressureError, HTTP: 503 + Retry-After); -1: unbounded (Serve's default).
    max_queued_requests: int = Field(256, ge=-1)
    # Serve options merged over the computed ones, validated against Serve's DeploymentConfig
    # (e.g. request_router_config, max_constructor_retry_count); see options.deployment_options.
    deployment_config: dict[str, Any] = Field(default_factory=dict)
    # Serve writes one access-log line per call; a layer tier is called once per model layer
    # per step, so that log costs real replica CPU at high request rates. Off unless asked.
    access_log: bool = False

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, v: Any) -> Any:
        if isinstance(v, dict) and "lane_lease_s" in v:
            raise ValueError("lane_lease_s was removed: sessions have no term to renew (they end when "
                             "closed, or session_linger_s after their last peer left)")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(
                f"deployment name {v!r} must start with a letter and use only letters, digits, '_' or '-'"
            )
        return v

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, v: Any) -> Any:
        # The CLI gives strings: layers=1,2 or layers="[1, 2]"; a single int is one layer.
        if isinstance(v, int) and not isinstance(v, bool):
            return [v]
        if isinstance(v, str):
            return parse_layers(v)
        return v

    @field_validator("tune_clock")
    @classmethod
    def _test_clock(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("tests."):
            raise ValueError(f"tune_clock {v!r}: only a clock of the project's tests package "
                             "('tests.<module>:<callable>') may replace the warm-up's clock; leave it unset")
        return v

    @field_validator("auto_tune_tokens", mode="before")
    @classmethod
    def _tune_tokens(cls, v: Any) -> Any:
        if isinstance(v, str):  # CLI: auto_tune_tokens=1,64,512 (or "" / none: off)
            body = v.strip().strip("[]").replace(" ", "")
            if body.lower() in ("", "none", "off"):
                return []
            try:
                return [int(p) for p in body.split(",") if p]
            except ValueError:
                raise ValueError(f"auto_tune_tokens must be comma-separated integers, got {v!r}") from None
        return v

    @field_validator("auto_tune_tokens")
    @classmethod
    def _positive_tokens(cls, v: list[int]) -> list[int]:
        if any(t < 1 for t in v):
            raise ValueError(f"auto_tune_tokens must be positive token counts, got {v}")
        return sorted(set(v))

    @field_validator("layers")
    @classmethod
    def _unique_layers(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("layers is empty; omit it to serve every MoE layer")
        dupes = sorted({x for x in v if v.count(x) > 1})
        if dupes:
            raise ValueError(f"layers lists {dupes} more than once")
        return sorted(v)

    @model_validator(mode="after")
    def _consistent(self) -> DeploymentSpec:
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("give either num_replicas or autoscaling bounds, not both")
        check_sequence_parallel_tail(self.tail, self.sequence_parallel)
        if self.accelerator == "cpu" and self.accelerator_type:
            raise ValueError(
                f"accelerator 'cpu' runs the ranks on CPU bundles, but accelerator_type "
                f"{self.accelerator_type!r} pins them to a GPU type; drop one of the two"
            )
        check_mxfp4_scale_rule(self.mxfp4_scale_rule, self.experts_activation_quant)
        check_order(self)
        return self

    @property
    def bounds(self) -> Bounds:
        """Every time bound of this deployment (``config.timeouts``)."""
        return Bounds.of(self)

    @property
    def max_forward_tokens(self) -> int:
        """Tokens of the largest forward: a batch, or one oversized request run alone."""
        return max(self.max_batch_tokens, self.max_tokens_per_request)


_DEPLOYMENT_FIELDS = set(DeploymentSpec.model_fields)
# Fields a running replica takes through Serve's user_config / reconfigure() (no restart).
BATCHING_KNOBS = ("max_batch_tokens", "batch_wait_timeout_s", "max_tokens_per_request")


def with_batching(spec: DeploymentSpec, user_config: dict[str, Any] | None) -> DeploymentSpec:
    """``spec`` with the batching knobs of ``user_config``, validated like the spec's fields."""
    user_config = user_config or {}
    unknown = sorted(set(user_config) - set(BATCHING_KNOBS))
    if unknown:
        raise ValueError(f"user_config of deployment {spec.name!r}: unknown key(s) {unknown}; "
                         f"it takes {list(BATCHING_KNOBS)}")
    try:
        return DeploymentSpec.model_validate({**spec.model_dump(), **user_config})
    except ValueError as e:
        raise ValueError(f"user_config of deployment {spec.name!r}: {e}") from None


def parse_layers(text: str) -> list[int] | None:
    """``"1,2"``, ``"[1, 2]"``, ``"1-23,30"`` -> sorted ints; ``"all"`` / empty -> None (every layer)."""
    body = text.strip().strip("[]").replace(" ", "")
    if not body or body.lower() in ("all", "none"):
        return None
    layers: list[int] = []
    try:
        for part in filter(None, body.split(",")):
            low, sep, high = part.partition("-")
            if sep:
                if int(high) < int(low):
                    raise ValueError(part)
                layers.extend(range(int(low), int(high) + 1))
            else:
                layers.append(int(part))
    except ValueError:
        raise ValueError(
            f"layers must be integers or ranges separated by commas (e.g. 1,2 or 1-23), got {text!r}"
        ) from None
    return layers


class AppArgs(BaseModel):
    """Arguments of ``build_app``: a checkpoint and one or more deployment specs.

    Every top-level deployment field is a default for each entry of ``deployments``; without
    ``deployments`` they describe the single deployment (named ``moe`` unless ``name`` is set).
    """

    model_config = ConfigDict(extra="forbid")

    checkpoint: str
    deployments: list[DeploymentSpec]
    http_max_body_bytes: int | None = Field(None, ge=1024)
    ingress_cpus: float = Field(0.1, gt=0)
    ingress_replicas: int = Field(2, ge=1)
    # Bound of an ingress -> deployment call (HTTP and app-handle paths); None: derived.
    request_timeout_s: float | None = Field(None, gt=0)
    # HTTP bearer token: the NAME of the environment variable the ingress reads where it runs (the
    # token itself is never an argument, so it cannot reach status(), logs or the Serve config);
    # unset or empty: HTTP is open. http_token_required: an ingress without it refuses to start.
    http_token_env: str = Field("LMS_HTTP_TOKEN", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    http_token_required: bool = False

    @model_validator(mode="before")
    @classmethod
    def _merge_defaults(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        defaults = {k: raw.pop(k) for k in list(raw) if k in _DEPLOYMENT_FIELDS}
        entries = raw.get("deployments")
        if entries is None:
            raw["deployments"] = [defaults]
        elif isinstance(entries, list):
            merged = []
            for i, entry in enumerate(entries):
                if isinstance(entry, DeploymentSpec):
                    entry = entry.model_dump(exclude_unset=True)
                if not isinstance(entry, dict):
                    raise ValueError(f"deployments[{i}] must be a mapping, got {type(entry).__name__}")
                if "name" not in entry:
                    raise ValueError(f"deployments[{i}] needs a name (e.g. prefill, decode)")
                merged.append({**defaults, **entry})
            raw["deployments"] = merged
        return raw

    @model_validator(mode="after")
    def _unique_names(self) -> AppArgs:
        if not self.deployments:
            raise ValueError("deployments is empty: an app needs at least one deployment")
        names = [d.name for d in self.deployments]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"deployment names must be unique, {dupes} repeat")
        request_bound(self.request_timeout_s, self.deployments)
        return self

    @property
    def default_deployment(self) -> str:
        """The deployment behind ``/v1/layers/{layer}/forward`` and the app handle's default."""
        return self.deployments[0].name
