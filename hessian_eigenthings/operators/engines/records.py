"""What ``auto`` learnt of each model and curvature, in the process and on disk (NOTE [trace times],
NOTE [what auto remembers] in ``policy``).

A traced engine records its trace time under a key of the model and curvature, in the process and
in a small JSON file beside inductor's on-disk cache; ``auto`` reads it to decide whether a run is
long enough to repay a trace. Cost: one fingerprint of the model per operator (no tensor values).
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import hashlib
import inspect
import json
import os
import re
import stat
import sys
import tempfile
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# NOTE [trace times]
# `auto` must guess, before tracing, what a trace will cost (NOTE [auto engine]).
# The best guess is what tracing this model's product cost last time: every
# general trace records its time under a key of the model and curvature — the
# model's code (the source files of its module classes), structure (modules,
# their plain attributes and modes, parameter and buffer names, shapes,
# dtypes, devices and ties), the selected parameters, the curvature's type and
# the code of the functions it calls (loss, forward), and the versions of
# Python, torch and this package (its source files' digest) — in the process
# and in `hessian_eigenthings_trace_times.json` beside inductor's cache
# (`HESSIAN_EIGENTHINGS_TRACE_TIMES`: a directory for it, or "0" for none;
# written atomically, read only when it is this user's and no one else can
# write it; the MAX_RECORDS most recent models).
# Storing the traced programs themselves was built and measured, and did not
# pay once traces were recorded (NOTE [recording a trace]): a program found
# by such a key must be checked before use (the key cannot see a global flag a
# model reads), and the check, the product run eagerly once, cost as much as
# recording anew. On the CPU (torch 2.13), a second process's first GPT-2
# (reduced) Hessian product took 0.80 s with a stored program (check 0.54 s)
# against 0.74 s tracing (0.34 s), GGN 0.92 s against 0.30 s, ResNet-18
# Hessian 1.87 s against 1.74 s. A compiled program is reused across processes
# without it: a recording is deterministic, so the same model and batch shapes
# give the same program code, which inductor's own cache finds.

ENV = "HESSIAN_EIGENTHINGS_TRACE_TIMES"
FILE = "hessian_eigenthings_trace_times.json"
#: models whose trace times are kept on disk (the most recent)
MAX_RECORDS = 256
#: bumped when what a key covers changes
FORMAT = 1


def inductor_cache_base() -> str:
    """Inductor's on-disk cache directory (the compile-time and trace-time records live in it):
    ``$TORCHINDUCTOR_CACHE_DIR``, else the default inductor derives (the temporary directory and
    the login name, as ``getpass`` finds it; ``$USER`` alone is unset in many containers), without
    importing inductor or creating the directory."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return os.path.abspath(env)
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        getuid = getattr(os, "getuid", None)
        user = f"uid_{getuid()}" if callable(getuid) else "unknown_user"
    return os.path.join(
        tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)
    )


def record_dir() -> str | None:
    """Where trace times are kept on disk (``None``: nowhere)."""
    env = os.environ.get(ENV)
    if env is not None:
        if env.strip().lower() in ("", "0", "off", "false", "no", "none"):
            return None
        return env
    return inductor_cache_base()


# -- keys ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=512)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    del mtime_ns, size  # part of the cache key: an edited file is read again
    try:
        with open(path, "rb") as f:
            return hashlib.sha1(f.read()).hexdigest()
    except OSError:
        return ""


def source_digest(obj: Any) -> str:
    """Digest of the source file that defines ``obj`` ("" where there is none)."""
    try:
        path = inspect.getsourcefile(obj)
    except (TypeError, OSError):
        return ""
    if not path:
        return ""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return _file_digest(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=1)
def _package_digest() -> str:
    from hessian_eigenthings._version import __version__

    # this file is hessian_eigenthings/operators/engines/records.py
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    h = hashlib.sha1(__version__.encode())
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                st = os.stat(path)
                h.update(os.path.relpath(path, root).encode())
                h.update(_file_digest(path, st.st_mtime_ns, st.st_size).encode())
    return h.hexdigest()


_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device)


def _code_fp(code: types.CodeType) -> tuple[Any, ...]:
    consts = tuple(
        _code_fp(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts
    )
    return (code.co_name, code.co_code, code.co_names, code.co_varnames, consts)


def _value_fp(value: Any, model: nn.Module, depth: int = 2) -> Any:
    """A process-independent fingerprint of what a curvature calls or reads (no tensor values)."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if value is model:
        return "<model>"
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)) and depth > 0:
        return tuple(_value_fp(v, model, depth - 1) for v in value[:64])
    if isinstance(value, dict) and depth > 0:
        return tuple(
            (repr(k), _value_fp(v, model, depth - 1)) for k, v in sorted(value.items(), key=repr)
        )
    if isinstance(value, functools.partial):
        return ("partial", _value_fp(value.func, model, depth), _value_fp(value.args, model, depth))
    if isinstance(value, types.MethodType):
        return (
            "method",
            _value_fp(value.__func__, model, depth),
            type(value.__self__).__qualname__,
        )
    if isinstance(value, types.FunctionType):
        cells = tuple(
            _value_fp(c.cell_contents, model, depth - 1) if depth > 0 else "?"
            for c in (value.__closure__ or ())
            if _cell_set(c)
        )
        return ("fn", value.__module__, value.__qualname__, _code_fp(value.__code__), cells)
    if isinstance(value, nn.Module):
        return ("module", type(value).__module__, type(value).__qualname__, value.extra_repr())
    cls = type(value)
    if depth > 0 and cls.__module__.startswith("hessian_eigenthings.loss_fns"):
        return (cls.__qualname__, _plain_attrs(value))
    return (cls.__module__, cls.__qualname__)


def _cell_set(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _plain_attrs(obj: Any) -> tuple[Any, ...]:
    return tuple(
        (k, repr(v))
        for k, v in sorted(vars(obj).items())
        if not k.startswith("_") and k != "training" and isinstance(v, _PLAIN)
    )


def model_fingerprint(model: nn.Module) -> tuple[Any, ...]:
    """Modules (class, its source, plain attributes, repr, mode), parameters and buffers (names,
    shapes, dtypes, devices, ties); no tensor values."""
    configs: dict[int, str] = {}
    rows: list[Any] = []
    for name, m in model.named_modules(remove_duplicate=False):
        cls = type(m)
        extra: list[Any] = []
        for k, v in sorted(vars(m).items()):
            to_dict = getattr(v, "to_dict", None)
            if not k.startswith("_") and callable(to_dict) and not isinstance(v, nn.Module):
                if id(v) not in configs:
                    try:
                        configs[id(v)] = repr(sorted(to_dict().items(), key=lambda kv: kv[0]))
                    except Exception:  # a config that cannot say itself: its class only
                        configs[id(v)] = type(v).__qualname__
                extra.append((k, configs[id(v)]))
        rows.append(
            (
                name,
                cls.__module__,
                cls.__qualname__,
                source_digest(cls),
                m.training,
                _plain_attrs(m),
                tuple(extra),
                m.extra_repr(),
            )
        )
    first: dict[int, str] = {}
    for kind, named in (
        ("p", model.named_parameters(remove_duplicate=False)),
        ("b", model.named_buffers(remove_duplicate=False)),
    ):
        for n, t in named:
            tied = first.setdefault(id(t), n)
            rows.append(
                (kind, n, tied, tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad)
            )
    return tuple(rows)


def structure_key(model: nn.Module, names: list[str], product: Callable[..., Any]) -> str:
    """What a program depends on except the batch (NOTE [trace times])."""
    owner = getattr(product, "__self__", None)
    curvature: Any = ()
    if owner is not None:
        cls = type(owner)
        curvature = (
            cls.__module__,
            cls.__qualname__,
            source_digest(cls),
            tuple(
                (k, _value_fp(v, model))
                for k, v in sorted(vars(owner).items())
                if callable(v) or type(v).__module__.startswith("hessian_eigenthings.loss_fns")
            ),
        )
    parts = (
        FORMAT,
        sys.version_info[:2],
        torch.__version__,
        _package_digest(),
        model_fingerprint(model),
        tuple(names),
        _value_fp(product, model),
        curvature,
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def private_dir(path: str, create: bool) -> bool:
    """``path`` is a directory of this user's that no one else can write (made so if ``create``)."""
    try:
        if create:
            os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return False
    return not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def own_file(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return False
    return stat.S_ISREG(st.st_mode) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class TraceTimes:
    """What was learnt of each model-and-curvature key, in the process and on disk (NOTE [trace
    times], NOTE [what auto remembers]): ``trace_s`` (a trace's time), ``functional_ratio`` (the
    functional engine's product time over autograd's in ``auto``'s last trial), ``products``
    (how many products an ``auto`` operator of it had made when last counted) and
    ``autograd_ms``; beside them each key's hint (``any_decision``)."""

    def __init__(self) -> None:
        self._facts: dict[str, dict[str, float]] = {}
        #: facts this process noted for itself alone (``note_in_process``), over the record's
        self._process_only: dict[str, dict[str, float]] = {}
        #: each key's hint (``any_decision``): a cheap description of its model and curvature
        self._hints: dict[str, str] = {}
        #: the file's contents as last read: (path, mtime_ns, size) and the data
        self._read_cache: tuple[tuple[str, int, int], dict[str, Any]] | None = None

    def clear(self) -> None:
        """Forget the process's facts (the file is left as it is)."""
        self._facts.clear()
        self._process_only.clear()
        self._hints.clear()
        self._read_cache = None

    def note(self, structure: str, seconds: float) -> None:
        """Record that tracing ``structure``'s product took ``seconds``."""
        self.note_facts(structure, trace_s=round(seconds, 4))

    def note_facts(self, structure: str, hint: str | None = None, **facts: float) -> None:
        """Record facts of ``structure`` (merged into what is known of it), and its ``hint``."""
        entry = {**self._recorded(structure), **facts}
        self._facts[structure] = entry
        own = self._process_only.get(structure)
        if own is not None:  # what the run counts now supersedes what it noted for itself
            for k in facts:
                own.pop(k, None)
        if hint is not None:
            self._hints[structure] = hint
        hint = self._hints.get(structure)
        stored: dict[str, Any] = entry if hint is None else {**entry, "hint": hint}
        folder = record_dir()
        if folder is None or not private_dir(folder, create=True):
            return
        path = os.path.join(folder, FILE)
        try:
            data = self._read(path)
            if data.get(structure) == stored:
                return  # the file holds this already (a rerun's counts): not written again
            data.pop(structure, None)  # most recent last: the oldest go first
            data[structure] = stored
            data = dict(list(data.items())[-MAX_RECORDS:])
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except (OSError, ValueError, TypeError):
            pass

    def note_in_process(self, structure: str, **facts: float) -> None:
        """Facts of ``structure`` for this process only: ``facts`` answers them, the file keeps
        what it holds and later writes do not carry them (until noted again)."""
        self._process_only.setdefault(structure, {}).update(facts)

    def _read(self, path: str) -> dict[str, Any]:
        """The file's records (a copy; parsed again only when the file changed)."""
        if not own_file(path):
            return {}
        st = os.stat(path)
        stamp = (path, st.st_mtime_ns, st.st_size)
        if self._read_cache is not None and self._read_cache[0] == stamp:
            return dict(self._read_cache[1])
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            return {}
        self._read_cache = (stamp, data)
        return dict(data)

    def any_decision(self, hint: str, min_products: float) -> bool:
        """Whether some key with this ``hint`` holds what deciding before a product is timed
        needs (NOTE [what auto remembers]: a functional/autograd ratio under 1, a trace time,
        autograd's product time, and a run of at least ``min_products``): a look at the record
        that makes no key, so that a first product makes its key only where a decision for a
        model like its own could follow (a hint shared by two models costs a key, no more)."""
        entries: dict[str, tuple[Any, Any]] = {}
        folder = record_dir()
        if folder is not None:
            with contextlib.suppress(OSError, ValueError, TypeError):
                entries = {
                    k: (v.get("hint"), v)
                    for k, v in self._read(os.path.join(folder, FILE)).items()
                    if isinstance(v, dict)
                }
        # what this process knows of a key comes before the file's
        known = set(self._facts) | set(self._process_only)
        entries.update((k, (self._hints.get(k), self.facts(k))) for k in known)
        return any(
            h == hint
            and all(isinstance(e.get(k), (int, float)) for k in FACTS)
            and e["functional_ratio"] < 1.0
            and e["products"] >= min_products
            for h, e in entries.values()
        )

    def facts(self, structure: str) -> dict[str, float]:
        """What is known of ``structure`` (empty: nothing recorded): the record, and what this
        process noted for itself alone (``note_in_process``)."""
        return {**self._recorded(structure), **self._process_only.get(structure, {})}

    def _recorded(self, structure: str) -> dict[str, float]:
        """What the record holds of ``structure``, as this process read or wrote it."""
        if structure in self._facts:
            return dict(self._facts[structure])
        folder = record_dir()
        if folder is None:
            return {}
        with contextlib.suppress(OSError, ValueError, TypeError):
            value = self._read(os.path.join(folder, FILE)).get(structure)
            if isinstance(value, (int, float)):  # a record of session 14: a trace time alone
                return {"trace_s": float(value)}
            if isinstance(value, dict):
                known = {
                    k: float(v)
                    for k, v in value.items()
                    if k in FACTS and isinstance(v, (int, float)) and v >= 0
                }
                hint = value.get("hint")
                if isinstance(hint, str):
                    self._hints.setdefault(structure, hint)
                return known
        return {}

    def expected_s(self, structure: str) -> float | None:
        """What tracing ``structure``'s product cost last time (``None``: never recorded)."""
        return self.facts(structure).get("trace_s")


#: what a record may hold of a key
FACTS = ("trace_s", "functional_ratio", "products", "autograd_ms")


#: the process's record (tests clear it, and point HESSIAN_EIGENTHINGS_TRACE_TIMES elsewhere)
TRACE_TIMES = TraceTimes()
