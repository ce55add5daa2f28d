"""Every torch / triton version check of the package lives here, nowhere else.

Versions are compared with :mod:`packaging.version` only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from packaging.version import Version

TORCH_VERSION = Version(torch.__version__.split("+")[0])

#: Oldest torch this package supports (see pyproject.toml).
MIN_TORCH = Version("2.4")


@functools.lru_cache(maxsize=1)
def triton_version() -> Version | None:
    """Installed triton version, or ``None`` when triton does not import."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        import triton
    except Exception:  # a broken triton install must not break the package
        return None
    return Version(triton.__version__.split("+")[0])


def has_triton() -> bool:
    return triton_version() is not None


@functools.lru_cache(maxsize=1)
def compile_supported() -> bool:
    """Whether ``torch.compile`` can run here (dynamo lags new Python releases)."""
    try:
        from torch._dynamo.eval_frame import is_dynamo_supported
    except Exception:
        return False
    return bool(is_dynamo_supported())


def _sdp_switches() -> list[tuple[Callable[[], bool], Callable[[bool], None], bool]] | None:
    """``(get, set, on under math-only)`` for every SDPA backend switch of this torch.

    ``None`` when a backend has a setter but no getter (its state could not be
    restored): then :func:`math_sdpa` uses torch's ``sdpa_kernel`` context.
    """
    switches = []
    for name in dir(torch._C):
        if not name.startswith("_set_sdp_use_"):
            continue
        backend = name[len("_set_sdp_use_") :]
        getter = getattr(torch._C, f"_get_{backend}_sdp_enabled", None)
        if getter is None:
            return None
        switches.append((getter, getattr(torch._C, name), backend == "math"))
    return switches if any(on for _, _, on in switches) else None


_SDP_SWITCHES = _sdp_switches()


@contextlib.contextmanager
def math_sdpa() -> Iterator[None]:
    """Force the math backend of ``scaled_dot_product_attention``.

    The flash and memory-efficient SDPA kernels have no double backward; the
    math backend does. Used for the duration of a second-order product, so it
    is on the hot path: flipping torch's backend switches directly costs a few
    microseconds, ``torch.nn.attention.sdpa_kernel`` about twenty (its
    fallback where a switch cannot be read back).
    """
    if _SDP_SWITCHES is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            yield
        return
    saved = [get() for get, _, _ in _SDP_SWITCHES]
    try:
        for _, set_, on in _SDP_SWITCHES:
            set_(on)
        yield
    finally:
        for (_, set_, _), was in zip(_SDP_SWITCHES, saved, strict=True):
            set_(was)


def foreach_add_(dst: list[torch.Tensor], src: list[torch.Tensor], alpha: float = 1.0) -> None:
    """``dst[i] += alpha * src[i]`` with one grouped launch where torch allows it."""
    if not dst:
        return
    if dst[0].device.type == "meta":
        return
    torch._foreach_add_(dst, src, alpha=alpha)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` with grouped launches (``_foreach_copy_`` exists from 2.2)."""
    if not dst:
        return
    torch._foreach_copy_(dst, src)


def cuda_allocated(device: torch.device) -> int:
    """``torch.cuda.memory_allocated(device)`` without flattening every allocator statistic.

    ``memory_allocated`` builds the flat ``memory_stats`` dict (hundreds of
    entries, about 0.3 ms on the host) to read one number; operators read it
    around every state they build, which showed on short runs.
    """
    return _current(device, "allocated_bytes")


def cuda_reserved(device: torch.device) -> int:
    """``torch.cuda.memory_reserved(device)``, read like :func:`cuda_allocated`."""
    return _current(device, "reserved_bytes")


def _current(device: torch.device, stat: str) -> int:
    # empty before CUDA is initialized, like memory_stats (whose readers default to 0)
    return int(
        torch.cuda.memory_stats_as_nested_dict(device)
        .get(stat, {})
        .get("all", {})
        .get("current", 0)
    )


def _flushes_denormals() -> bool:
    """Whether this thread's CPU flushes subnormal floats to zero (FTZ/DAZ)."""
    return bool((torch.tensor([1e-310], dtype=torch.float64) * 1.0).item() == 0.0)


@contextlib.contextmanager
def denormals_kept() -> Iterator[None]:
    """Undo a switch to flush-to-zero made inside: torch 2.4's inductor loads CPU kernels
    built with fast-math, whose loading turns on FTZ/DAZ for the whole process (seen: a compiled
    product on torch 2.4.1 left ``1e-310 * 1.0 == 0``; numpy then warns that float32's
    smallest subnormal is zero). The user's floating-point mode is theirs: restored after."""
    before = _flushes_denormals()
    try:
        yield
    finally:
        if not before and _flushes_denormals():
            torch.set_flush_denormal(False)


def all_gather_single(output: Any, tensor: Any, group: Any = None) -> None:
    """``output`` ← every rank's ``tensor``, rank by rank (flat). ``all_gather_into_tensor`` was
    renamed ``all_gather_single`` in torch 2.13, and the old name warns there."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def reduce_scatter_single(output: Any, tensor: Any, group: Any = None) -> None:
    """``output`` ← this rank's chunk of the sum of every rank's ``tensor`` (flat).
    ``reduce_scatter_tensor`` was renamed ``reduce_scatter_single`` in torch 2.13."""
    import torch.distributed as dist

    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, tensor, group=group)


def all_gather_single_async(output: Any, tensor: Any, group: Any = None) -> Any:
    """:func:`all_gather_single` issued without waiting: the collective's work, whose ``wait()``
    returns once ``output`` holds every rank's ``tensor`` (on CUDA: once the current stream waits
    for it). Every torch from 2.4 takes ``async_op`` under either name."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=True)


def reduce_scatter_single_async(output: Any, tensor: Any, group: Any = None) -> Any:
    """:func:`reduce_scatter_single` issued without waiting: the collective's work, whose
    ``wait()`` returns once ``output`` holds this rank's chunk of the sum."""
    import torch.distributed as dist

    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, tensor, group=group, async_op=True)


def fully_shard() -> Any:
    """FSDP2's ``fully_shard``: public in ``torch.distributed.fsdp`` from torch 2.6,
    under ``torch.distributed._composable.fsdp`` on 2.4 and 2.5."""
    if Version("2.6") <= TORCH_VERSION:
        from torch.distributed.fsdp import fully_shard as public

        return public
    from torch.distributed._composable.fsdp import fully_shard as private  # type: ignore[attr-defined]

    return private


def fsdp2_runs_on_cpu() -> bool:
    """Whether FSDP2 can shard a CPU model (gloo): from torch 2.6. On 2.4 its
    first forward creates CUDA streams unconditionally."""
    return Version("2.6") <= TORCH_VERSION


class CapturableScalars(torch.overrides.TorchFunctionMode):
    """``torch.tensor(<Python scalar>, device=<cuda>)`` as a fill kernel, for CUDA-graph captures.

    Building a scalar tensor on the GPU copies it from pageable host memory,
    which a capture refuses ("Cannot copy between CPU and CUDA tensors during
    CUDA graph capture"). Models do it in their forward (HuggingFace's eager
    attention mask does). ``torch.full`` writes the same value with a kernel
    that a graph can record; every other call passes through unchanged.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.tensor and len(args) == 1 and isinstance(args[0], (bool, int, float)):
            device = kwargs.get("device")
            if (
                device is not None
                and torch.device(device).type == "cuda"
                and set(kwargs) <= {"device", "dtype", "requires_grad"}
            ):
                value = args[0]
                dtype = kwargs.get("dtype")
                if dtype is None:
                    dtype = (
                        torch.bool
                        if isinstance(value, bool)
                        else torch.int64
                        if isinstance(value, int)
                        else torch.get_default_dtype()
                    )
                out = torch.full((), value, dtype=dtype, device=device)
                return out.requires_grad_() if kwargs.get("requires_grad") else out
        return func(*args, **kwargs)


def make_fx_real(fn: Callable[..., Any], *, data_dependent_ok: bool) -> Callable[..., Any]:
    """``make_fx`` in real tracing mode; ``data_dependent_ok`` lets the traced Python read
    tensor values (``.item()``), baking them into the graph (NOTE [tangent split])."""
    import inspect

    from torch.fx.experimental.proxy_tensor import make_fx

    if "_error_on_data_dependent_ops" in inspect.signature(make_fx).parameters:
        traced = make_fx(
            fn, tracing_mode="real", _error_on_data_dependent_ops=not data_dependent_ok
        )
    else:
        traced = make_fx(fn, tracing_mode="real")

    def run(*args: Any) -> Any:
        with _one_fake_mode():
            return traced(*args)

    return run


# The recorder of the traced engines (`operators.engines.recorder`, NOTE [recording a trace])
# marks its recordings here, where `tracing()` reads them.
#: recordings in progress (``tracing()`` is true inside one)
_RECORDING = [0]


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """A recording of aten ops in progress: ``tracing()`` is true inside, so code that writes
    into tensors outside torch's dispatcher takes its traced path, as under ``make_fx``."""
    _RECORDING[0] += 1
    try:
        yield
    finally:
        _RECORDING[0] -= 1


# NOTE [one fake mode per trace]
# A real-mode trace records each node's value as a fake tensor (`meta["val"]`).
# torch makes it under the fake mode it detects, and with none detected it
# builds a fresh `FakeTensorMode` per node: on HF GPT-2 (4 layers d768, CPU)
# that was about a fifth of the trace. One fake mode for the whole trace, made
# visible through a tracing context, serves them all. Where torch lacks these
# private names the trace runs as before.


@contextlib.contextmanager
def _one_fake_mode() -> Iterator[None]:
    try:
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:  # pragma: no cover - older torch: a mode per node, as torch does
        yield
        return
    if TracingContext.try_get() is not None:
        yield  # inside a caller's compile: its context stays
        return
    with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
        yield


# NOTE [inductor's caches for an aten graph]
# Inductor keeps compiled graphs on disk (its FX graph cache, and AOT
# autograd's cache in front of it), but it looks them up only where a
# tracing context holds a fake mode with a shape environment, which dynamo
# provides and a direct `torch._inductor.compile` call does not: every
# compilation of ours was a "bypass" ("No shape env"), and a second process
# compiled GPT-2 6L's tangent program in 18 s against the first's 22 (H200,
# torch 2.11). The compiler below supplies that context: a fake mode with a
# shape environment and static shapes (the program is compiled for the
# sizes it was traced at, as before), so the next process's identical
# program is a cache hit. Inside a caller's compile its context stays.


@functools.lru_cache(maxsize=1)
def inductor_backend() -> Callable[..., Any]:
    """Inductor's compiler for an aten graph: ``(graph_module, example_inputs) -> compiled``
    (``torch._inductor.compile``: no dynamo frame, so no guards and no recompilation), with
    inductor's on-disk caches in reach (NOTE [inductor's caches for an aten graph]).

    Inductor's first import defines TorchScript modules through deprecated
    ``torch.jit`` APIs, which warn; it is imported here once, quietly.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\..*deprecated")
        import torch._inductor
        import torch._inductor.compile_fx

    compile_fx = torch._inductor.compile

    def compile_cached(gm: Any, example_inputs: list[Any]) -> Any:
        try:
            from torch._guards import TracingContext, tracing
            from torch._subclasses.fake_tensor import FakeTensorMode
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            if TracingContext.try_get() is not None:
                return compile_fx(gm, example_inputs)
            fake = FakeTensorMode(
                shape_env=ShapeEnv(), static_shapes=True, allow_non_fake_inputs=True
            )
        except (ImportError, TypeError):  # pragma: no cover - older torch: no cache, as before
            return compile_fx(gm, example_inputs)
        with tracing(TracingContext(fake)):
            return compile_fx(gm, example_inputs)

    return compile_cached


def inductor_graph_cache_on() -> bool:
    """Whether inductor keeps compiled graphs on disk (off by default before torch 2.5)."""
    try:
        import torch._inductor.config as config
    except ImportError:  # pragma: no cover - no inductor
        return False
    return bool(getattr(config, "fx_graph_cache", False))


def inductor_cache_hits() -> int:
    """How many compilations of this process found their graph in inductor's FX graph cache."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - no dynamo: no cache
        return 0
    return int(counters["inductor"].get("fxgraph_cache_hit", 0))


def tracing() -> bool:
    """Whether the code runs under ``make_fx`` or ``torch.compile`` tracing (kernels that
    launch outside torch's dispatcher must not run then)."""
    if torch.compiler.is_compiling() or _RECORDING[0]:
        return True
    # make_fx's proxy mode on the dispatch-mode stack (the public getter came after 2.4)
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


@functools.lru_cache(maxsize=1)
def load_forward_ad_decompositions() -> None:
    """Import torch's forward-mode decompositions once per process.

    Their first use compiles them with the deprecated ``torch.jit.script``,
    which warns: torch's own business, not the user's. Loading them here,
    once, keeps later products free of warning filters. The warning is dropped
    where it is shown (``warnings.showwarning``), not by a filter: changing the
    filters, even inside ``catch_warnings``, makes Python forget which call
    sites have warned already, so a once-per-call-site warning of the user's
    (a 0.x deprecation) would be shown again after the first trace. Where the
    user's filters turn the warning into an error, a filter is the fallback.
    """
    import warnings

    shown = warnings.showwarning

    def quiet(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if not re.search(r"torch\.jit\.script.*deprecated", str(message)):
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = quiet
    try:
        with contextlib.suppress(ImportError):  # a torch without them: nothing to preload
            import torch._decomp.decompositions_for_jvp
    except Warning:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*deprecated")
            with contextlib.suppress(ImportError):
                import torch._decomp.decompositions_for_jvp  # noqa: F401
    finally:
        warnings.showwarning = shown
