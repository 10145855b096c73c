"""The backend contract: what a framework backend module supplies to the neutral core.

A backend (``hp_dtensor.platform.torch``, ``hp_dtensor.platform.mindspore``) is a module whose
public names satisfy ``Backend``; each backend's ``__init__`` asserts so for mypy, and
``platform.current()`` is typed by it, so a name missing from one backend or a signature that drifts
fails ``pants check`` instead of a run on the other framework.  Tensors, modules and groups are the
framework's own objects, so they are ``Any`` here; the shapes of the calls are what is fixed.  The
contract is neutral code, defined by the package that uses it (as ``hp_fsdp.primitives`` is), so
the platform folders hold only what implements it.

Features a backend may lack (the RNG primitives ``RNG``) are not part of the contract: they are
reached through ``platform.backend_primitives``, typed by the feature's own Protocol, and fail with
``NotImplementedError`` where absent.  Packages above the DTensor (FSDP, tensor parallelism,
checkpoints) keep their framework code in their own ``platform/`` folders, not here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from hp_dtensor.placement_types import Placement
from hp_dtensor.redistribute.executor import PlanPrimitives


class Collectives(PlanPrimitives, Protocol):
    """Collectives along one mesh dim, native or composed, one signature each: ``group`` is the
    dim's process group, ``n`` its size and ``index`` this rank's coordinate on it.  Collectives
    get equal pieces only (callers pad uneven shards).  The plan walker (``redistribute_exec``)
    uses the ``PlanPrimitives`` part; nothing outside the walker and the backend's collectives
    module issues communication."""

    def barrier(self, group: Any, n: int) -> None: ...

    def gather_int_rows(self, rows: list[list[int]], group: Any, n: int, index: int) -> list[list[int]]:
        """Every group member's int64 ``rows`` (same count and width everywhere), concatenated in
        group order, exactly."""
        ...

    def all_gather_object(self, obj: Any, group: Any, n: int, index: int) -> list[Any]:
        """Every group member's picklable ``obj``, in group order (sizes may differ by rank)."""
        ...


class Backend(Protocol):
    """The names every backend module exports (see the module docstring)."""

    NAME: str
    #: The method a module's call runs (``forward`` / ``construct``).
    FORWARD: str

    # ----- process groups -----
    #: The mesh device kinds this backend runs collectives on (``device_mesh.check_device_type``).
    DEVICE_TYPES: tuple[str, ...]

    def default_device_type(self) -> str:
        """The device kind of a mesh nobody named (``fully_shard`` without a mesh): the
        accelerator when there is one, else "cpu"."""
        ...

    def is_initialized(self) -> bool: ...

    def ensure_process_group(self, device_type: str) -> None: ...

    def init_rank(self, backend: str | None, path: str, rank: int, world_size: int, timeout_s: float) -> None:
        """Join a job as ``rank`` of ``world_size``; ``backend=None`` is the backend's CPU
        default; a backend it cannot honour raises ``ValueError``."""
        ...

    def init_fake(self, rank: int, world_size: int) -> None: ...

    def serve_scheduler(self) -> None:
        """Run the rendezvous service a launcher starts next to the workers (where one exists)."""
        ...

    def destroy(self) -> None: ...

    def get_rank(self) -> int: ...

    def get_world_size(self) -> int: ...

    def get_or_create_group(self, ranks: tuple[int, ...]) -> Any: ...

    def world_generation(self) -> int:
        """Changes whenever a new default group starts in this process: a mesh's groups belong
        to the default group it was built under."""
        ...

    def set_num_threads(self, n: int) -> None: ...

    # ----- collectives -----
    @property
    def COLLECTIVES(self) -> Collectives: ...

    # ----- tensors -----
    @property
    def DTensor(self) -> type[Any]: ...

    def distribute_tensor(
        self,
        tensor: Any,
        device_mesh: Any = None,
        placements: Sequence[Placement] | Placement | None = None,
        *,
        src_data_rank: int | None = 0,
    ) -> Any: ...

    def is_tensor(self, x: Any) -> bool: ...

    def numel(self, t: Any) -> int: ...

    def init_param_(self, param: Any, kind: str, std: float = 0.02) -> None:
        """Initialize in place: ``normal`` (mean 0, ``std``), ``zeros`` or ``ones``."""
        ...

    # ----- modules: introspection and hooks -----
    @property
    def Module(self) -> type[Any]: ...

    @property
    def ModuleList(self) -> type[Any]: ...

    @property
    def ModuleDict(self) -> type[Any]: ...

    @property
    def Sequential(self) -> type[Any]: ...

    @property
    def Parameter(self) -> type[Any]: ...

    def is_module(self, obj: Any) -> bool: ...

    def is_linear_module(self, m: Any) -> bool: ...

    def is_embedding_module(self, m: Any) -> bool: ...

    def named_children(self, m: Any) -> Iterator[tuple[str, Any]]: ...

    def named_modules(self, m: Any) -> Iterator[tuple[str, Any]]: ...

    def parameters(self, m: Any) -> list[Any]: ...

    def state_dict(self, m: Any) -> dict[str, Any]: ...

    def direct_params(self, m: Any) -> list[tuple[str, Any]]: ...

    def direct_buffers(self, m: Any) -> list[tuple[str, Any]]: ...

    def register_param(self, m: Any, name: str, param: Any) -> None: ...

    def register_buffer(self, m: Any, name: str, value: Any) -> None: ...

    def add_child(self, m: Any, name: str, child: Any) -> None: ...

    def set_param(self, m: Any, name: str, value: Any) -> None: ...

    def share_param(self, m: Any, name: str, param: Any) -> None: ...

    def set_buffer(self, m: Any, name: str, value: Any) -> None: ...

    def register_forward_pre_hook(self, m: Any, hook: Callable[..., Any], *, with_kwargs: bool = False) -> Any: ...

    def register_forward_hook(self, m: Any, hook: Callable[..., Any]) -> Any: ...

    # ----- RNG -----
    @property
    def RNG(self) -> Any:
        """The backend's ``RNGPrimitives`` (typed by ``rng_tracker``, which owns that Protocol)."""
        ...


def _members(proto: type) -> list[str]:
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n in vars(proto) if not n.startswith("_")}
    return sorted(n for n in names if not n.startswith("_"))


def contract_gaps(backend: Any) -> list[str]:
    """What ``backend`` (a module) lacks of the contract: missing names, missing collectives, and
    functions whose parameter names differ.  mypy checks the types; this runs when a backend is
    selected, so a backend loaded without type checking fails at selection, naming the gap."""
    gaps = [name for name in _members(Backend) if not hasattr(backend, name)]
    coll = getattr(backend, "COLLECTIVES", None)
    wanted = sorted(set(_members(Collectives)) | set(_members(PlanPrimitives)))
    gaps += [f"COLLECTIVES.{name}" for name in wanted if not hasattr(coll, name)]
    for name in _members(Backend):
        want, got = vars(Backend).get(name), getattr(backend, name, None)
        if inspect.isfunction(want) and callable(got):
            want_params = list(inspect.signature(want).parameters)[1:]  # without self
            got_params = list(inspect.signature(got).parameters)
            if want_params != got_params:
                gaps.append(f"{name}{tuple(got_params)} instead of {name}{tuple(want_params)}")
    return gaps
