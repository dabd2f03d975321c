"""xpupack.source and xpupack.hub.resolve_source: which names are folders and which are Hub repos
(docs/hub.md, "Naming a package"). A folder is trusted to run its compiled artifacts, a Hub repo only when
pinned, so a name given as a repo id must never read a folder."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import xpupack
from xpupack.cli import main
from xpupack.examples import tiny_transformer
from xpupack.hub import resolve_source
from xpupack.source import local_folder, read_name

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def shadowing_folder(demo_eager_package, tmp_path, monkeypatch) -> Path:
    """A package at ./org/name in the working directory, as `hf download org/name --local-dir org/name` or a
    git clone puts it."""
    monkeypatch.chdir(tmp_path)
    return shutil.copytree(demo_eager_package, tmp_path / "org" / "name")


@pytest.mark.parametrize(
    "name, folder, repo_id",
    [
        ("org/name", None, "org/name"),
        ("hf://org/name", None, "org/name"),
        ("hf://gpt2", None, "gpt2"),
        ("./org/name", "org/name", None),
        ("../org/name", "../org/name", None),
        ("org/name/", "org/name", None),
        ("/abs/org/name", "/abs/org/name", None),
        ("tiny-pkg", "tiny-pkg", None),
        ("out/x/pkg", "out/x/pkg", None),
        ("my pkgs/tiny", "my pkgs/tiny", None),  # no repo id has a space
        ("org/.hidden", "org/.hidden", None),
        (".", ".", None),
    ],
)
def test_names_read_as_a_folder_or_a_hub_repo(name, folder, repo_id):
    read = read_name(name)
    assert (read.folder, read.repo_id) == (Path(folder) if folder else None, repo_id)


def test_a_path_object_and_a_home_path_are_folders():
    assert read_name(Path("org/name")).folder == Path("org/name")
    assert read_name("~/pkgs/tiny").folder == Path.home() / "pkgs" / "tiny"


@pytest.mark.parametrize("name", ["", "hf://", "hf://org/na me", "hf://a/b/c", 42])
def test_a_name_that_names_nothing_is_refused(name):
    with pytest.raises(xpupack.SourceError):
        read_name(name)


def test_a_hub_id_that_is_also_a_folder_here_is_refused_not_loaded_as_the_trusted_folder(shadowing_folder):
    model = tiny_transformer(99)
    before = model(TOKENS)
    with pytest.raises(xpupack.AmbiguousSourceError) as caught:
        xpupack.load(model, "org/name")
    message = str(caught.value)
    assert "'./org/name'" in message and "hf://org/name" in message and "pathlib.Path('org/name')" in message
    assert isinstance(caught.value, ValueError)
    torch.testing.assert_close(model(TOKENS), before)  # untouched


@pytest.mark.parametrize(
    "how",
    [lambda: "./org/name", lambda: Path("org/name"), lambda: "org/name/", lambda: str(Path.cwd() / "org" / "name")],
)
def test_a_folder_named_as_a_folder_loads_trusted(shadowing_folder, how):
    source = resolve_source(how())
    assert source.trusted and source.root.resolve() == shadowing_folder.resolve()
    model = xpupack.load(tiny_transformer(99), how())
    torch.testing.assert_close(model(TOKENS), tiny_transformer(0)(TOKENS))


def test_the_explicit_hub_form_never_reads_the_folder(shadowing_folder, monkeypatch):
    asked = []
    monkeypatch.setattr("xpupack.hub.download", lambda repo_id, **kwargs: asked.append((repo_id, kwargs)))
    resolve_source("hf://org/name")
    assert asked == [("org/name", {"revision": None, "trust_compiled": False, "token": None, "plain": False})]


def test_a_missing_folder_is_said_at_once_without_asking_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a request would fail, slowly
    for name, hint in [
        ("./pkgs/tiny", "name it 'pkgs/tiny' or 'hf://pkgs/tiny'"),
        ("pkgs/x/tiny", ""),
        ("tiny", "a Hub repo is named 'org/name'"),
    ]:
        with pytest.raises(
            xpupack.SourceError, match=f"there is no folder {tmp_path / name.removeprefix('./')}"
        ) as caught:
            xpupack.load(tiny_transformer(), name)
        assert hint in str(caught.value)


def test_a_plain_repo_id_with_no_folder_and_no_hub_answers_at_once_naming_both(tmp_path, monkeypatch):
    """A mistyped folder that reads as `org/name` does not wait for huggingface_hub's retries (about 20 s)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    started = time.monotonic()
    result = CliRunner().invoke(main, ["inspect", "pkgs/tiny"])
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"error: 'pkgs/tiny' names a Hub repo (no folder {tmp_path / 'pkgs/tiny'} "
        "exists here either; a folder is named './pkgs/tiny'): cannot reach the Hub"
    )
    assert time.monotonic() - started < 10  # not a timing threshold on speed: the retries alone take 23 s


def test_revision_for_a_folder_is_a_value_error_with_a_fix(demo_eager_package):
    with pytest.raises(xpupack.SourceError, match="revision='main' selects a version of a Hub repo") as caught:
        xpupack.load(tiny_transformer(), demo_eager_package, revision="main")
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "command",
    [
        ["inspect", "org/name"],
        ["verify", "org/name"],
        ["bench", "org/name", "--model", "xpupack.examples:tiny_transformer"],
    ],
)
def test_the_commands_refuse_a_hub_id_that_is_also_a_folder(shadowing_folder, command):
    result = CliRunner().invoke(main, command)
    assert result.exit_code == (3 if command[0] == "verify" else 1)
    assert result.stderr.startswith("error: 'org/name' names the Hub repo org/name, and a folder")
    assert "Traceback" not in result.output


def test_the_commands_read_a_folder_named_as_one(shadowing_folder):
    inspected = CliRunner().invoke(main, ["inspect", "./org/name", "--json"])
    assert inspected.exit_code == 0, inspected.output
    assert '"trust_reason": "local directory"' in inspected.stdout
    assert CliRunner().invoke(main, ["verify", "./org/name"]).exit_code == 0


def test_push_reads_its_package_as_a_folder_only_when_named_as_one(shadowing_folder, monkeypatch):
    with pytest.raises(
        xpupack.SourceError, match="names the Hub repo org/name, not a folder; name the folder as './org/name'"
    ):
        xpupack.push("org/name", "org/other")
    assert local_folder("./org/name") == Path("org/name")
    with pytest.raises(xpupack.SourceError, match="push needs a Hub repo named 'org/name'"):
        xpupack.push("./org/name", "other")  # a bare name would be created under the token's user
