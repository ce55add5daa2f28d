"""Python bytecode of written programs, kept in the process and on disk (NOTE [stored bytecode]).

Cost: one digest of the program's text per trace; a hit skips Python's compiler.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import marshal
import os
import sys
import types

from hessian_eigenthings.operators.engines.records import own_file, private_dir, record_dir

# NOTE [stored bytecode]
# A written program's text (NOTE [programs written directly]) is compiled to
# bytecode by Python's compiler: on GPT-2 12L's graph at d64 (CPU, torch 2.13)
# 64 ms of a 0.34 s trace, for 12,800 lines. The bytecode is a function of the
# text and of the interpreter alone, so it is kept under a digest of both (the
# text, the file name it is compiled under, `importlib.util.MAGIC_NUMBER` and
# the optimisation level): in the process, and on disk in
# `hessian_eigenthings_programs/` beside the trace times (NOTE [trace times] in `records`;
# the folder and each file this user's, no one else able to write them, as for
# Python's own `.pyc` files; the MAX_CODES most recently used). A second
# process records its trace and writes the text as the first did, then loads
# the bytecode (marshal: 1.5-1.9 ms for either program of that graph) instead
# of compiling it. Unlike a stored program, nothing is taken on trust: the text
# is made anew by every trace, only its compilation is skipped. A file that
# cannot be read or is not bytecode is compiled anew and written again.

CODE_DIR = "hessian_eigenthings_programs"
#: programs whose bytecode is kept (in the process and on disk; the most recent)
MAX_CODES = 64
_codes: dict[str, types.CodeType] = {}


def program_code(text: str, filename: str) -> tuple[types.CodeType, str]:
    """``compile(text, filename, "exec")``, kept (NOTE [stored bytecode]); also where it came
    from: "compiled", "process" or "disk"."""
    interpreter = importlib.util.MAGIC_NUMBER + bytes([sys.flags.optimize])  # bytecode and -O
    digest = hashlib.sha256(interpreter + filename.encode() + b"\0" + text.encode()).hexdigest()[
        :40
    ]
    code = _codes.pop(digest, None)
    source = "process"
    folder = record_dir()
    where = None if folder is None else os.path.join(folder, CODE_DIR)
    path = None if where is None else os.path.join(where, digest + ".bytecode")
    if code is None and path is not None and where is not None and private_dir(where, False):
        code, source = _read_code(path), "disk"
        if code is not None:
            with contextlib.suppress(OSError):
                os.utime(path)  # recently used: the last to go (MAX_CODES)
    if code is None:
        code, source = compile(text, filename, "exec"), "compiled"
        if path is not None and where is not None and folder is not None:
            _write_code(folder, where, path, code)
    _codes[digest] = code  # most recent last
    while len(_codes) > MAX_CODES:
        del _codes[next(iter(_codes))]
    return code, source


def _read_code(path: str) -> types.CodeType | None:
    if not own_file(path):
        return None
    try:
        with open(path, "rb") as f:
            code = marshal.loads(f.read())
    except (OSError, EOFError, ValueError, TypeError):
        return None
    return code if isinstance(code, types.CodeType) else None


def _write_code(folder: str, where: str, path: str, code: types.CodeType) -> None:
    if not (private_dir(folder, create=True) and private_dir(where, create=True)):
        return
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(marshal.dumps(code))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        kept = sorted(
            (e for e in os.scandir(where) if e.name.endswith(".bytecode")),
            key=lambda e: e.stat().st_mtime_ns,
        )
        for old in kept[: max(0, len(kept) - MAX_CODES)]:
            os.remove(old.path)
    except OSError:
        pass
