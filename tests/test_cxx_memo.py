"""The test run's memo of the C++ compiler (tests/support/cxx_memo.py): it answers only builds it can see whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import cxx_memo

MEMO = Path(cxx_memo.__file__)


@pytest.fixture
def stable(tmp_path) -> Path:
    folder = tmp_path / "site-packages" / "torch" / "include"
    folder.mkdir(parents=True)
    return folder


def _source(tmp_path, text: str = "int f() { return 1; }\n", name: str = "kernel.cpp") -> Path:
    path = tmp_path / "cache" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def test_a_kernel_build_is_keyed_by_its_source_bytes_and_flags_not_by_where_it_lies(tmp_path, stable):
    roots = (str(stable.parent.parent),)
    source = _source(tmp_path)
    argv = [str(source), "-O3", f"-I{stable}", "-shared", "-o", str(source.with_suffix(".so"))]
    key, output = cxx_memo.memo_key(argv, roots, "salt")
    assert output == str(source.with_suffix(".so"))
    moved = tmp_path / "elsewhere" / "kernel.cpp"
    moved.parent.mkdir()
    moved.write_bytes(source.read_bytes())
    assert cxx_memo.memo_key([str(moved), *argv[1:4], "-o", str(moved.with_suffix(".so"))], roots, "salt")[0] == key
    assert cxx_memo.memo_key(argv, roots, "another compiler")[0] != key
    assert cxx_memo.memo_key([*argv[:1], "-O0", *argv[2:]], roots, "salt")[0] != key
    source.write_text("int f() { return 2; }\n")
    assert cxx_memo.memo_key(argv, roots, "salt")[0] != key


@pytest.mark.parametrize(
    "change",
    ["preprocess only", "an include folder outside the stable ones", "two sources", "a quoted include", "no output"],
)
def test_a_build_the_memo_cannot_see_whole_goes_to_the_compiler(tmp_path, stable, change):
    roots = (str(stable.parent.parent),)
    source = _source(tmp_path, '#include "next_to_me.h"\n' if change == "a quoted include" else "int f();\n")
    argv = [str(source), f"-I{stable}", "-shared", "-o", str(source.with_suffix(".so"))]
    if change == "preprocess only":
        argv.append("-E")
    elif change == "an include folder outside the stable ones":
        argv += ["-I", str(tmp_path / "generated")]
    elif change == "two sources":
        argv.insert(0, str(_source(tmp_path, name="other.cpp")))
    elif change == "no output":
        argv = argv[:-2]
    assert cxx_memo.memo_key(argv, roots, "salt") is None


def test_the_second_build_of_a_kernel_is_copied_from_the_memo_without_the_compiler(tmp_path, stable):
    calls = tmp_path / "calls"
    compiler = tmp_path / "fake-g++"  # "builds" by copying the source, and counts its runs
    compiler.write_text(
        f"#!{sys.executable}\nimport sys\nopen({str(calls)!r}, 'a').write('x')\n"
        "args = sys.argv[1:]\nif '-o' in args:\n    open(args[args.index('-o') + 1], 'w').write(open(args[0]).read())\n"
    )
    compiler.chmod(0o755)
    env = {
        **os.environ,
        "XPUPACK_TEST_CXX": str(compiler),
        "XPUPACK_TEST_CXX_MEMO": str(tmp_path / "memo"),
        "XPUPACK_TEST_CXX_STABLE": str(stable.parent.parent),
        "XPUPACK_TEST_CXX_SALT": "salt",
    }
    outputs = []
    for folder in ("first", "second"):
        source = _source(tmp_path, name=f"{folder}.cpp")
        output = source.with_suffix(".so")
        subprocess.run([sys.executable, str(MEMO), str(source), "-shared", "-o", str(output)], env=env, check=True)
        outputs.append(output.read_text())
    assert outputs[0] == outputs[1] == "int f() { return 1; }\n"
    assert calls.read_text() == "x"  # the compiler ran once
    subprocess.run([sys.executable, str(MEMO), "--version"], env=env, check=True)
    assert calls.read_text() == "xx"  # anything else goes to it


def test_a_memo_that_cannot_keep_a_build_still_hands_it_over(tmp_path, stable):
    compiler = tmp_path / "fake-g++"
    compiler.write_text(f"#!{sys.executable}\nimport sys\nargs = sys.argv[1:]\nopen(args[-1], 'w').write('built')\n")
    compiler.chmod(0o755)
    blocked = tmp_path / "memo"
    blocked.write_text("a file where the memo's folder should be")
    env = {
        **os.environ,
        "XPUPACK_TEST_CXX": str(compiler),
        "XPUPACK_TEST_CXX_MEMO": str(blocked),
        "XPUPACK_TEST_CXX_STABLE": str(stable.parent.parent),
    }
    source = _source(tmp_path)
    output = source.with_suffix(".so")
    result = subprocess.run(
        [sys.executable, str(MEMO), str(source), "-shared", "-o", str(output)], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0 and output.read_text() == "built"
    assert "not kept" in result.stderr
