import json
import os

import pytest
import torch
from safetensors import safe_open

import xpupack
from support.backends import CountingBackend
from support.models import make_stack, stack_samples
from support.strategies import EAGER
from xpupack.errors import DestinationExistsError, SaveError
from xpupack.examples import tiny_transformer, tiny_transformer_samples
from xpupack.manifest import check_files, read_manifest, validate


@pytest.fixture
def tuned_stack():
    model = make_stack()
    return xpupack.tune(model, stack_samples(), modules=["layers.*.mlp"], strategy=EAGER)


def test_layout_manifest_and_digests(tuned_stack, tmp_path):
    root = xpupack.save(tuned_stack, tmp_path / "pkg")
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert files == [
        "README.md",
        "model.safetensors",
        "modules/layers.0.mlp/spec.json",
        "modules/layers.1.mlp/spec.json",
        "xpupack.json",
    ]
    manifest = read_manifest(root)
    check_files(root, manifest)
    assert manifest["format_version"] == 1
    assert [m["path"] for m in manifest["modules"]] == ["layers.0.mlp", "layers.1.mlp"]
    assert set(manifest["files"]) == set(files) - {"README.md", "xpupack.json"}
    assert manifest["environment"]["torch"] == torch.__version__
    spec = json.loads((root / "modules/layers.0.mlp/spec.json").read_text())
    validate(spec, "spec", "spec.json")
    assert len(spec["signatures"]) == 2
    card = (root / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: xpupack\n")


def test_no_sample_values_and_no_pickle_in_the_package(tmp_path):
    model = make_stack()
    marker = torch.full((2, 8), 1234.5)
    xpupack.tune(model, [marker], modules=["layers.*.mlp"], strategy=EAGER)
    root = xpupack.save(model, tmp_path / "pkg")
    with safe_open(str(root / "model.safetensors"), "pt") as weights:
        assert set(weights.keys()) == set(model.state_dict())
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not data.startswith(b"\x80"), f"{path} looks like a pickle"
            assert b"1234.5" not in data


def test_tied_weights_are_stored_once(tmp_path):
    model = xpupack.tune(tiny_transformer(), tiny_transformer_samples(), modules=["layers.*.mlp"], strategy=EAGER)
    root = xpupack.save(model, tmp_path / "pkg")
    manifest = read_manifest(root)
    assert manifest["model"]["aliases"] == {"head.weight": "embed.weight"}
    with safe_open(str(root / "model.safetensors"), "pt") as weights:
        assert "head.weight" not in weights.keys() and "embed.weight" in weights.keys()  # noqa: SIM118 (safe_open is no dict)


def test_without_weights(tuned_stack, tmp_path):
    root = xpupack.save(tuned_stack, tmp_path / "pkg", weights=False)
    assert not (root / "model.safetensors").exists()
    assert read_manifest(root)["model"]["weights"] is None


def test_failed_save_keeps_the_previous_package_and_leaves_no_litter(tuned_stack, tmp_path, monkeypatch):
    root = xpupack.save(tuned_stack, tmp_path / "pkg")
    before = (root / "xpupack.json").read_bytes()
    backend = xpupack.tuned.session_of(tuned_stack).modules["layers.1.mlp"].backend

    def broken_save(runner, folder):
        raise OSError("disk full")

    monkeypatch.setattr(backend, "save", broken_save)
    with pytest.raises(SaveError, match="disk full.*unchanged"):
        xpupack.save(tuned_stack, root)
    assert (root / "xpupack.json").read_bytes() == before
    check_files(root, read_manifest(root))
    assert sorted(os.listdir(tmp_path)) == ["pkg"]


def test_save_replaces_an_existing_package(tuned_stack, tmp_path):
    root = xpupack.save(tuned_stack, tmp_path / "pkg")
    (root / "README.md").write_text("a card edited by hand")  # the card is xpupack's to rewrite
    xpupack.save(xpupack.tune(make_stack(seed=3), stack_samples(), modules=["layers.0.mlp"], strategy=EAGER), root)
    assert not (root / "modules" / "layers.1.mlp").exists()
    check_files(root, read_manifest(root))
    assert "edited by hand" not in (root / "README.md").read_text()
    assert sorted(os.listdir(tmp_path)) == ["pkg"]


def test_save_refuses_to_replace_a_directory_that_is_not_a_package(tuned_stack, tmp_path):
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(SaveError, match="not an xpupack package"):
        xpupack.save(tuned_stack, precious)
    assert (precious / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("path", [".", "", "./", "..", "sub/..", "/"])
def test_save_to_the_current_directory_says_to_name_a_folder(tuned_stack, tmp_path, monkeypatch, path):
    """``save(model, ".")`` said "PosixPath('.') has an empty name"; a package replaces its folder as a whole,
    so it needs a folder of its own."""
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SaveError, match="names the current directory, a parent or the root") as error:
        xpupack.save(tuned_stack, path)
    assert "xpupack.save(model, 'pkg')" in str(error.value) and "nothing was changed" in str(error.value)
    assert sorted(os.listdir(tmp_path)) == ["sub"] and not os.listdir(tmp_path / "sub")


def _tree(root):
    """Every file, link and folder under ``root`` with its content: what a refused save must leave as it was."""
    return {
        p.relative_to(root).as_posix(): (
            p.read_bytes() if p.is_file() and not p.is_symlink() else str(os.readlink(p)) if p.is_symlink() else "dir"
        )
        for p in sorted(root.rglob("*"))
    }


def _project_folder(root, tuned):
    root.mkdir()
    (root / "xpupack.json").write_text('{"build": "my own config"}')
    (root / "src").mkdir()
    (root / "src" / "main.py").write_text("print('mine')\n")
    (root / "notes.txt").write_text("keep me")


def _git_clone_of_a_package(root, tuned):
    xpupack.save(tuned, root)
    (root / ".git" / "refs" / "heads").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / ".git" / "refs" / "heads" / "main").write_text("0" * 40 + "\n")  # a local commit


def _package_with_a_note(root, tuned):
    xpupack.save(tuned, root)
    (root / "modules" / "notes.txt").write_text("keep me")


def _package_with_a_link(root, tuned):
    xpupack.save(tuned, root)
    (root / "data").symlink_to(root.parent)


@pytest.mark.parametrize(
    "make, unexpected",
    [
        (_project_folder, "not a valid xpupack manifest"),
        (_git_clone_of_a_package, ".git/HEAD"),
        (_package_with_a_note, "modules/notes.txt"),
        (_package_with_a_link, "data"),
    ],
)
def test_save_replaces_only_a_package_xpupack_wrote(tuned_stack, tmp_path, make, unexpected):
    """A directory is replaced only when its manifest validates and it holds nothing the manifest does not
    list (besides the model card): anything else may be someone's work, and is left exactly as it was."""
    root = tmp_path / "dest"
    make(root, tuned_stack)
    before = _tree(root)
    with pytest.raises(DestinationExistsError) as caught:
        xpupack.save(tuned_stack, root)
    assert isinstance(caught.value, SaveError) and caught.value.path == str(root)
    message = str(caught.value)
    assert str(root) in message and unexpected in message and "refusing to replace it" in message
    assert "save to another directory" in message
    assert _tree(root) == before
    assert sorted(os.listdir(tmp_path)) == ["dest"]


def test_stale_staging_of_a_dead_process_is_cleaned(tuned_stack, tmp_path):
    stale = tmp_path / ".pkg.xpupack-tmp-999999999-abcd"
    stale.mkdir()
    xpupack.save(tuned_stack, tmp_path / "pkg")
    assert not stale.exists()


def test_objects_in_calls_do_not_break_tuning_or_saving(tmp_path):
    class Cache:
        def __init__(self):
            self.seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Linear(4, 4)

        def forward(self, x, cache):
            cache.seen.append(x.shape)
            return self.block(x)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Model()
            self.head = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.head(self.inner(x, cache=Cache()))

    model = xpupack.tune(
        Outer(),
        [torch.randn(1, 4)],
        modules=["inner", "head"],
        strategy=xpupack.FirstWins([CountingBackend(), xpupack.EagerBackend()], min_speedup=None),
    )
    root = xpupack.save(model, tmp_path / "pkg")
    spec = json.loads((root / "modules/inner/spec.json").read_text())
    assert spec["signatures"] == [] and list(spec["unrecordable"].values()) == [1]
    assert xpupack.stats(model)["head"]["backend"] == "counting"
