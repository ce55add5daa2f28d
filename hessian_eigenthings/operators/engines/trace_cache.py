"""Traced programs kept for reuse, in the process and on disk (NOTE [trace reuse]).

A general program (NOTE [tangent split] in ``tracing``) is stored under a key of everything it was
traced from; a new operator, or a second process, finds it there instead of tracing again, and
checks it once against the function it was traced from. Cost: a load is unpickling the programs'
Python code (about a tenth of a second per thousand graph nodes); the check is one product run
twice (traced and eagerly).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import inspect
import json
import os
import stat
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hessian_eigenthings.operators.engines.tracing import SplitProgram

# NOTE [trace reuse]
# Tracing is host work, about a millisecond per aten op of the product (13.7-21 s
# on GPT-2 12L on an H100 host), paid by every new operator before its first
# traced product. What a general program computes is fixed by: the model's code
# (the source files of its module classes), its structure (modules, their plain
# attributes and modes, parameter and buffer names, shapes, dtypes, devices and
# ties), which parameters are selected, the curvature's type and the code of the
# functions it calls (loss, forward), the batch's signature, the default dtype
# and autocast state, and the versions of Python, torch and this package (its
# source files' digest, so an edited checkout is a new version). A program is
# stored under the digest of all that:
# - in the process, for a later operator on the same model and batch shapes
#   (MAX_IN_PROCESS programs, the most recently used);
# - on disk, beside inductor's cache (`HESSIAN_EIGENTHINGS_TRACE_CACHE`: a
#   directory, or "0" for none), as the programs' pickled Python code and no
#   tensor values (MAX_ON_DISK programs, the most recently written). Files are
#   written atomically, and read only from a directory and files owned by this
#   user that no one else can write.
# The key cannot see everything that a module's Python reads (a global flag, an
# attribute of an object it does not own), so a program that was found, rather
# than traced, is checked on its first batch in each operator: its product for
# a fixed pseudo-random direction (a private generator: the caller's RNG is
# untouched) against the pure product run eagerly, the very function that was
# traced, to MISMATCH_TOL. A program that differs is dropped everywhere and the
# product is traced again. Programs specialized to one batch are never stored.
# The store also records, per model and curvature, the last trace's time and a
# load's, for `auto`'s estimate of what a trace will cost (NOTE [auto engine]).

ENV = "HESSIAN_EIGENTHINGS_TRACE_CACHE"
MAX_IN_PROCESS = 32
#: programs kept on disk (the most recently written; a GPT-2 12L Hessian's is a few MB)
MAX_ON_DISK = 64
#: bumped when what a stored program holds changes
FORMAT = 1


def inductor_cache_base() -> str:
    """Inductor's on-disk cache directory (the compile-time record and stored traces live beside it)."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"torchinductor_{os.environ.get('USER', 'user')}"
    )


def cache_dir() -> str | None:
    """Where programs are stored on disk (``None``: nowhere)."""
    env = os.environ.get(ENV)
    if env is not None:
        if env.strip().lower() in ("", "0", "off", "false", "no", "none"):
            return None
        return env
    return os.path.join(inductor_cache_base(), "hessian_eigenthings_traces")


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

    # this file is hessian_eigenthings/operators/engines/trace_cache.py
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
    """What a program depends on except the batch (NOTE [trace reuse])."""
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


def program_key(structure: str, signature: Any) -> str:
    """The stored program's key: the structure's, the batch signature and global settings."""
    parts = (
        structure,
        signature,
        str(torch.get_default_dtype()),
        torch.is_autocast_enabled(),
        torch.are_deterministic_algorithms_enabled(),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


# -- the store -------------------------------------------------------------------------


def _private_dir(path: str, create: bool) -> bool:
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


def _own_file(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return False
    return stat.S_ISREG(st.st_mode) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class TraceStore:
    """Programs by key, in the process and on disk, and per-structure trace and load times."""

    def __init__(self) -> None:
        self._programs: collections.OrderedDict[str, SplitProgram] = collections.OrderedDict()
        self._times: dict[str, dict[str, float]] = {}

    # -- programs ---------------------------------------------------------------------
    def get(self, structure: str, key: str) -> tuple[SplitProgram, str] | None:
        """The program stored under ``key`` and where it was found ("process" or "disk")."""
        prog = self._programs.get(key)
        if prog is not None:
            self._programs.move_to_end(key)
            return prog, "process"
        folder = cache_dir()
        if folder is None or not _private_dir(folder, create=False):
            return None
        path = os.path.join(folder, f"{structure}-{key}.pt")
        if not _own_file(path):
            return None
        t0 = time.perf_counter()
        try:
            with _quiet_load():
                data = torch.load(path, weights_only=False, map_location="cpu")
            if data.get("format") != FORMAT:
                return None
            prog = SplitProgram(
                data["primal"],
                data["tangent"],
                data["num_kept"],
                data["key"],
                True,
                data["trace_s"],
                data["nodes"],
                reads_state=data["reads_state"],
                takes_batch=data["takes_batch"],
                blocks=dict(data["blocks"]),
            )
        except Exception:  # an unreadable or foreign file is a miss
            return None
        prog.cache_key = (structure, key)
        self._remember(key, prog)
        self.note_time(structure, "load_s", time.perf_counter() - t0)
        return prog, "disk"

    def put(self, structure: str, key: str, prog: SplitProgram) -> None:
        """Keep ``prog`` in the process and write it to disk (best effort)."""
        prog.cache_key = (structure, key)
        self._remember(key, prog)
        self.write(prog)

    def write(self, prog: SplitProgram) -> None:
        """(Re)write ``prog``'s file (its blocks grow as block widths are traced)."""
        folder = cache_dir()
        if prog.cache_key is None or folder is None or not _private_dir(folder, create=True):
            return
        structure, key = prog.cache_key
        path = os.path.join(folder, f"{structure}-{key}.pt")
        data = {
            "format": FORMAT,
            "primal": prog.primal,
            "tangent": prog.tangent,
            "blocks": dict(prog.blocks),
            "num_kept": prog.num_kept,
            "key": prog.key,
            "trace_s": prog.trace_s,
            "nodes": prog.nodes,
            "reads_state": prog.reads_state,
            "takes_batch": prog.takes_batch,
        }
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with _quiet_load():
                torch.save(data, tmp)
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except Exception:  # a program that does not pickle, a full or read-only disk
            with contextlib.suppress(OSError):
                os.remove(tmp)
            return
        _prune(folder)

    def drop(self, prog: SplitProgram) -> None:
        """Forget ``prog`` everywhere (it failed its check)."""
        if prog.cache_key is None:
            return
        structure, key = prog.cache_key
        self._programs.pop(key, None)
        folder = cache_dir()
        if folder is not None:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, f"{structure}-{key}.pt"))
        prog.cache_key = None

    def _remember(self, key: str, prog: SplitProgram) -> None:
        self._programs[key] = prog
        self._programs.move_to_end(key)
        while len(self._programs) > MAX_IN_PROCESS:
            self._programs.popitem(last=False)

    def clear(self) -> None:
        """Forget the process's programs and times (the disk is left as it is)."""
        self._programs.clear()
        self._times.clear()

    # -- what a trace costs -----------------------------------------------------------
    def _times_path(self) -> str | None:
        folder = cache_dir()
        return None if folder is None else os.path.join(folder, "times.json")

    def note_time(self, structure: str, what: str, seconds: float) -> None:
        """Record a trace's (``trace_s``) or a load's (``load_s``) time for ``structure``."""
        self._times.setdefault(structure, {})[what] = round(seconds, 4)
        path = self._times_path()
        if path is None or not _private_dir(os.path.dirname(path), create=True):
            return
        try:
            data = self._read_times(path)
            data.pop(structure, None)  # most recent last: the oldest go first
            data[structure] = {**self._times[structure]}
            data = dict(list(data.items())[-MAX_ON_DISK * 4 :])
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except (OSError, ValueError, TypeError):
            pass

    @staticmethod
    def _read_times(path: str) -> dict[str, dict[str, float]]:
        if not _own_file(path):
            return {}
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}

    def expected_s(self, structure: str) -> tuple[float, str] | None:
        """What the next traced program of ``structure`` is expected to cost, and why: a stored
        program's load, else the last trace's time; ``None`` when nothing is known."""
        if any(
            p.cache_key is not None and p.cache_key[0] == structure for p in self._programs.values()
        ):
            return 0.0, "a program of this model is kept in the process"
        known = dict(self._times.get(structure, {}))
        path = self._times_path()
        folder = cache_dir()
        if path is not None:
            with contextlib.suppress(OSError, ValueError):
                known = {**self._read_times(path).get(structure, {}), **known}
        stored = False
        if folder is not None and _private_dir(folder, create=False):
            with contextlib.suppress(OSError):
                stored = any(n.startswith(structure + "-") for n in os.listdir(folder))
        if stored:
            return float(known.get("load_s", 1.0)), "a program of this model is stored on disk"
        if "trace_s" in known:
            return float(known["trace_s"]), "this model's last trace"
        return None


def _prune(folder: str) -> None:
    """Keep the MAX_ON_DISK most recently written programs of ``folder``."""
    with contextlib.suppress(OSError):
        files = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".pt")]
        if len(files) <= MAX_ON_DISK:
            return
        files.sort(key=lambda f: os.stat(f).st_mtime_ns)
        for f in files[:-MAX_ON_DISK]:
            os.remove(f)


@contextlib.contextmanager
def _quiet_load() -> Iterator[None]:
    # pickling GraphModules may warn about their own internals; not the user's business
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


#: the process's store (tests clear it, or point HESSIAN_EIGENTHINGS_TRACE_CACHE elsewhere)
TRACE_STORE = TraceStore()
