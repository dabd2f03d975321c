"""Interrupted saves: SIGKILL at any step leaves the previous package loadable; litter is never a package."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import xpupack
from support.models import make_stack, stack_samples
from support.strategies import EAGER
from xpupack.errors import PackageFormatError, SaveError

TESTS = os.path.dirname(__file__)


def _tuned(seed=0):
    return xpupack.tune(make_stack(seed=seed), stack_samples(), modules=["layers.*.mlp"], strategy=EAGER)


@pytest.mark.slow
@pytest.mark.parametrize("swap", ["exchange", "rename"])
def test_sigkill_at_every_step_of_a_save_leaves_a_loadable_package(swap, tmp_path, run_python):
    """``exchange``: Linux renameat2 swaps old and new in one step. ``rename``: where it is missing, the old
    package is renamed aside first; a kill right then leaves the destination missing until the next save
    puts the old package back (and a load says where it is)."""
    folder = tmp_path / "packages"
    folder.mkdir()
    result = run_python(
        f"import json; from support import kill_points; "
        f"print(json.dumps(kill_points.sweep({str(folder)!r}, exchange={swap == 'exchange'})))"
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    steps, cases = report["steps"], report["cases"]
    assert steps >= 20 and len(cases) == steps + 1
    assert all(case["killed"] for case in cases[:-1]) and not cases[-1]["killed"]
    found = [case["loads"] for case in cases]
    missing = [i for i, loads in enumerate(found) if loads not in ("old", "new")]
    if swap == "exchange":
        assert missing == []
    else:  # one step: between the two renames
        assert len(missing) == 1
        case = cases[missing[0]]
        assert "moved aside" in case["loads"] and case["after_recovery"] == "old"
    present = [loads for loads in found if loads in ("old", "new")]
    assert present == sorted(present, key=["old", "new"].index)  # old until the swap, new after it
    assert found[0] == "old" and found[-1] == "new"
    for case in cases:
        assert all(name.startswith(".pkg.xpupack-") for name in case["litter"])
        assert all("temporary directory of `xpupack save`" in message for message in case["litter_loads"])
    assert report["final_litter"] == []  # the next save clears what dead savers left


_BLOCKING_SAVER = """
import os, signal, sys
import xpupack
from xpupack.cli import main

target = os.environ["KILL_BEFORE"]
state = {"armed": False}

def hook(event, args):
    if state["armed"] and event == target:
        state["armed"] = False
        print("reached", event, flush=True)
        sys.stdin.readline()  # the test kills us while we wait here

sys.addaudithook(hook)
save = xpupack.save

def armed_save(*args, **kwargs):
    state["armed"] = True
    return save(*args, **kwargs)

xpupack.save = armed_save
main(["build", "support.models:make_stack", "--samples", "support.models:stack_samples", "--modules", "layers.*.mlp",
      "--backends", "eager", "--out", sys.argv[1]], standalone_mode=False)
print("finished", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "event, expected",
    [
        ("os.mkdir", "old"),  # the temporary directory is being created
        ("open", "old"),  # the first file is being written
        ("ctypes.dlsym", "old"),  # looking up renameat2, right before it swaps the directories
        ("shutil.rmtree", "new"),  # swapped; the old package is being deleted
    ],
)
def test_killing_xpupack_build_from_outside(event, expected, tmp_path):
    """`xpupack build` is SIGKILLed by another process while it waits at a step of `save`."""
    root = tmp_path / "pkg"
    old = _tuned(seed=5)
    xpupack.save(old, root)
    script = tmp_path / "saver.py"
    script.write_text(textwrap.dedent(_BLOCKING_SAVER))
    env = {**os.environ, "KILL_BEFORE": event, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    saver = subprocess.Popen(
        [sys.executable, str(script), str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        lines = [saver.stdout.readline()]
        while lines[-1] and not lines[-1].startswith("reached"):
            lines.append(saver.stdout.readline())
        assert lines[-1].startswith("reached"), ("".join(lines), saver.stderr.read())
        saver.send_signal(signal.SIGKILL)
    finally:
        saver.kill()
        saver.wait(timeout=60)
    assert saver.returncode == -signal.SIGKILL
    model = xpupack.load(make_stack(seed=9), root)
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(model(x), make_stack(seed=5 if expected == "old" else 0)(x))
    for litter in tmp_path.glob(".pkg.xpupack-*"):
        with pytest.raises(PackageFormatError, match="temporary directory"):
            xpupack.load(make_stack(), litter)
    xpupack.save(old, root)
    assert not list(tmp_path.glob(".pkg.xpupack-*"))


def test_a_live_savers_temporary_directory_is_left_alone(tmp_path):
    running = tmp_path / f".pkg.xpupack-tmp-{os.getpid()}-00000000"
    running.mkdir()
    xpupack.save(_tuned(), tmp_path / "pkg")
    assert running.is_dir()


def test_a_package_moved_aside_by_a_dead_saver_is_put_back_then_replaced(tmp_path):
    root = xpupack.save(_tuned(seed=1), tmp_path / "pkg")
    aside = tmp_path / ".pkg.xpupack-old-999999999"
    root.rename(aside)
    with pytest.raises(PackageFormatError, match=f"{aside.name} holds the package an interrupted save moved aside"):
        xpupack.load(make_stack(), root)
    xpupack.save(_tuned(seed=2), root)
    assert sorted(os.listdir(tmp_path)) == ["pkg"]


@pytest.mark.parametrize("planted", ["a link", "a file"])
@pytest.mark.parametrize("existing", [False, True])
def test_a_link_or_file_named_like_a_moved_aside_package_is_none_of_save_s_business(tmp_path, planted, existing):
    """A link at ``.pkg.xpupack-old-PID`` was put in the package's place and the save then failed after
    writing (rmtree of a link); now save leaves it alone, and writes the package as ever."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mine.txt").write_text("mine")
    aside = tmp_path / ".pkg.xpupack-old-999999999"
    if planted == "a link":
        aside.symlink_to(elsewhere, target_is_directory=True)
    else:
        aside.write_text("not a package")
    if existing:
        xpupack.save(_tuned(seed=1), tmp_path / "pkg")
    root = xpupack.save(_tuned(seed=2), tmp_path / "pkg")
    assert root.is_dir() and not root.is_symlink()
    model = xpupack.load(make_stack(), root)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), make_stack(seed=2)(x))
    assert sorted(os.listdir(tmp_path)) == sorted([aside.name, "elsewhere", "pkg"])
    assert os.listdir(elsewhere) == ["mine.txt"] and aside.is_symlink() == (planted == "a link")


def test_saving_through_a_symlink_replaces_the_package_it_points_to(tmp_path):
    real = xpupack.save(_tuned(seed=1), tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    xpupack.save(_tuned(seed=2), link)
    assert link.is_symlink() and link.resolve() == real
    model = xpupack.load(make_stack(), link)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), make_stack(seed=2)(x))
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


def test_a_destination_that_cannot_be_created_is_a_save_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(SaveError, match="cannot write a package at .*file/pkg: .*file is not a directory"):
        xpupack.save(_tuned(), blocker / "pkg")
