"""A memo of the C++ compiler for the test run: Inductor's CPU kernels are built once per run, not once per process.

About half of a tiny Llama's compile on the 2-core CPU is g++ (a tune in a fresh process: 38 s, 23 s with the
memo warm), and every fresh process with an empty Inductor cache (what the cold-start and after-load tests must
start from) compiled the tiny models' kernels again, the same sources each time. The
root conftest points ``CXX`` at a shim that runs this file. A build whose output is fully determined by what the
memo can see — one source file, includes only from the stable prefixes (torch's and Python's headers) or a
precompiled header named by its content — is looked up by a hash of its command line and its inputs'
bytes; anything else (``-E``, several sources, a quoted include, a generated header folder) goes to the
compiler as is. Inductor, its caches and xpupack see an ordinary compiler: only g++'s own work is shared.

``XPUPACK_TEST_CXX_MEMO`` is the memo's folder (a run's own, or a developer's that lasts between runs),
``XPUPACK_TEST_CXX`` the real compiler, ``XPUPACK_TEST_CXX_SALT`` what else the output depends on (the
compiler's and torch's versions), ``XPUPACK_TEST_CXX_STABLE`` the include prefixes (``os.pathsep``-separated).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

SOURCES = (".cpp", ".cc", ".c")
OUTPUTS = (".so", ".o")
#: options whose value is the next argument and a path the output depends on
PATH_OPTIONS = ("-I", "-L", "-include", "-isystem")


def _digest(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


def _content_named(path: str) -> bool:
    """Inductor's precompiled headers are named by a hash of what they hold."""
    return os.path.basename(os.path.dirname(path)) == "precompiled_headers"


def memo_key(argv: list[str], stable: tuple[str, ...], salt: str) -> tuple[str, str] | None:
    """``(key, output)`` of a build the memo may answer, or ``None`` where the compiler must run."""
    parts, sources, output = [salt], [], None
    args = iter(argv)
    for arg in args:
        if arg == "-o":
            output = next(args, None)
            continue
        if arg in ("-E", "-x", "-M", "-MM"):
            return None
        option = next((option for option in PATH_OPTIONS if arg.startswith(option)), None)
        if option is not None:
            path = arg[len(option) :] or next(args, "")
            if option == "-include" and _content_named(path) and os.path.isfile(path):
                parts.append(f"-include:{_digest(path)}")
                continue
            if not os.path.realpath(path).startswith(stable):
                return None
            parts.append(f"{option}{path}")
            continue
        if arg.endswith(SOURCES) and os.path.isfile(arg):
            sources.append(arg)
            continue
        parts.append(arg)
    if len(sources) != 1 or output is None or not output.endswith(OUTPUTS):
        return None
    with open(sources[0], "rb") as file:
        source = file.read()
    if b'#include "' in source:  # a quoted include is found next to the source, which the key does not see
        return None
    parts.append(hashlib.sha256(source).hexdigest())
    parts.append(os.path.splitext(output)[1])
    return hashlib.sha256("\0".join(parts).encode()).hexdigest(), output


def _store(built: str, stored: str) -> None:
    fd, scratch = tempfile.mkstemp(dir=os.path.dirname(stored), prefix=".incoming-")
    os.close(fd)
    shutil.copyfile(built, scratch)
    os.replace(scratch, stored)  # another process building the same key at once stores the same bytes


def main(argv: list[str]) -> int:
    compiler = os.environ.get("XPUPACK_TEST_CXX", "g++")
    folder = os.environ.get("XPUPACK_TEST_CXX_MEMO")
    stable = tuple(filter(None, os.environ.get("XPUPACK_TEST_CXX_STABLE", "").split(os.pathsep)))
    found = memo_key(argv, stable, os.environ.get("XPUPACK_TEST_CXX_SALT", "")) if folder and stable else None
    if found is None:
        return subprocess.call([compiler, *argv])
    key, output = found
    stored = os.path.join(folder, key[:2], key + os.path.splitext(output)[1])
    if os.path.isfile(stored):
        shutil.copyfile(stored, output)
        return 0
    code = subprocess.call([compiler, *argv])
    if code == 0 and os.path.isfile(output):
        try:
            os.makedirs(os.path.dirname(stored), exist_ok=True)
            _store(output, stored)
        except OSError as exc:  # the build itself succeeded: a memo that cannot keep it only costs time
            print(f"cxx_memo: not kept ({exc})", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
