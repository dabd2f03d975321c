"""xpupack.hub: load, inspect and verify by repo id against a real Hub-compatible server (olah on
loopback, see `support/hub_server.py`); push at the `HfApi` boundary; the trust rule for compiled artifacts."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx2
import pytest
import torch
from click.testing import CliRunner
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.hf_api import CommitInfo

import xpupack
from xpupack.card import package_card
from xpupack.cli import main
from xpupack.examples import tiny_transformer, tiny_transformer_samples
from xpupack.hub import download
from xpupack.manifest import read_manifest
from xpupack.tuned import session_of

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))


def _build(tmp_path_factory, name: str, strategy, *, seed: int = 0, modules=("layers.*.mlp",)) -> Path:
    model = xpupack.tune(
        tiny_transformer(seed), tiny_transformer_samples(), modules=list(modules), device="cpu", strategy=strategy
    )
    return xpupack.save(model, tmp_path_factory.mktemp(name) / "pkg")


@pytest.fixture(scope="session")
def demo_eager_package_v2(tmp_path_factory) -> Path:
    """`demo_eager_package`'s architecture with other weights (seed 7), for revision tests."""
    return _build(tmp_path_factory, "eager-v2", xpupack.FirstWins([xpupack.EagerBackend()]), seed=7)


@pytest.fixture(scope="session")
def demo_inductor_package(tmp_path_factory) -> Path:
    """One MLP compiled with Inductor: a package with compiled artifacts (built once, ~20 s on CI)."""
    root = _build(tmp_path_factory, "inductor", xpupack.Only(xpupack.InductorBackend()), modules=("layers.0.mlp",))
    assert [m["backend"]["name"] for m in read_manifest(root)["modules"]] == ["inductor"]
    return root


def logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(TOKENS)


def reference(seed: int) -> torch.Tensor:
    return logits(tiny_transformer(seed))


def snapshot_files(source) -> set[str]:
    return {p.relative_to(source.root).as_posix() for p in source.root.rglob("*") if not p.is_dir()}


# ---------------------------------------------------------------- load by repo id


def test_load_by_repo_id_installs_the_package(hub, demo_eager_package):
    hub.publish(demo_eager_package, "xpupack-tests/load")
    model = xpupack.load(tiny_transformer(99), "xpupack-tests/load")
    torch.testing.assert_close(logits(model), reference(0))  # weights came from the package, not seed 99
    stats = xpupack.stats(model)
    assert {path: s["backend"] for path, s in stats.items()} == {"layers.0.mlp": "eager", "layers.1.mlp": "eager"}
    assert all(s["calls"] == 1 and s["fallbacks"] == 0 for s in stats.values())


def test_downloads_only_the_files_the_manifest_lists(hub, demo_eager_package):
    hub.publish(demo_eager_package, "xpupack-tests/only-listed", extra={"notes/large.bin": b"\0" * 200_000})
    before = len(hub.requests())
    source = download("xpupack-tests/only-listed")
    manifest = read_manifest(source.root)
    assert snapshot_files(source) == {"xpupack.json", *manifest["files"]}
    fetched = [r for r in hub.requests()[before:] if r.startswith("GET")]
    assert len(fetched) == 1 + len(manifest["files"])
    assert not any("README.md" in r or "notes/large.bin" in r for r in fetched)


def test_second_load_of_a_branch_downloads_nothing(hub, demo_eager_package):
    hub.publish(demo_eager_package, "xpupack-tests/twice")
    xpupack.load(tiny_transformer(), "xpupack-tests/twice")
    before = len(hub.requests())
    model = xpupack.load(tiny_transformer(99), "xpupack-tests/twice")
    # one HEAD asks where main points now; every file is taken from the cache
    assert hub.requests()[before:] == ["HEAD /xpupack-tests/twice/resolve/main/xpupack.json"]
    torch.testing.assert_close(logits(model), reference(0))


def test_second_load_of_a_pinned_commit_sends_no_request(hub, demo_eager_package):
    commit = hub.publish(demo_eager_package, "xpupack-tests/pinned-twice")
    xpupack.load(tiny_transformer(), "xpupack-tests/pinned-twice", revision=commit)
    before = len(hub.requests())
    xpupack.load(tiny_transformer(), "xpupack-tests/pinned-twice", revision=commit)
    assert hub.requests()[before:] == []


def test_offline_loads_and_inspects_from_the_cache(hub, demo_eager_package, monkeypatch):
    hub.publish(demo_eager_package, "xpupack-tests/offline")
    xpupack.load(tiny_transformer(), "xpupack-tests/offline")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(hub.requests())
    model = xpupack.load(tiny_transformer(99), "xpupack-tests/offline")
    result = CliRunner().invoke(main, ["inspect", "xpupack-tests/offline", "--json"])
    assert hub.requests()[before:] == []
    torch.testing.assert_close(logits(model), reference(0))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["modules"][0]["path"] == "layers.0.mlp"


def test_offline_with_nothing_cached_says_what_to_do(hub, demo_eager_package, monkeypatch):
    hub.publish(demo_eager_package, "xpupack-tests/offline-empty")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_transformer(99)
    with pytest.raises(xpupack.OfflineNotCachedError, match="HF_HUB_OFFLINE is set") as caught:
        xpupack.load(model, "xpupack-tests/offline-empty")
    assert "load it once online" in str(caught.value)
    torch.testing.assert_close(logits(model), reference(99))  # untouched


def test_branches_tags_and_commits_select_the_package(hub, demo_eager_package, demo_eager_package_v2):
    repo = "xpupack-tests/revisions"
    first = hub.publish(demo_eager_package, repo, message="v1")
    hub.tag(repo, "v1", first)
    hub.publish(demo_eager_package_v2, repo, message="v2")
    hub.publish(demo_eager_package, repo, branch="stable", message="stable")
    cases = {None: 7, first: 0, "v1": 0, "stable": 0, "main": 7}
    for revision, seed in cases.items():
        model = xpupack.load(tiny_transformer(99), repo, revision=revision)
        torch.testing.assert_close(logits(model), reference(seed), msg=f"revision {revision}")


def test_corrupted_file_on_the_hub_is_refused(hub, demo_eager_package, tmp_path):
    damaged = shutil.copytree(demo_eager_package, tmp_path / "damaged")
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, another sha256
    weights.write_bytes(bytes(data))
    hub.publish(damaged, "xpupack-tests/corrupted")
    model = tiny_transformer(99)
    with pytest.raises(xpupack.IntegrityError, match="model.safetensors does not match its sha256"):
        xpupack.load(model, "xpupack-tests/corrupted")
    torch.testing.assert_close(logits(model), reference(99))


def test_a_repo_named_hf_colon_loads_from_the_hub_untrusted_beside_a_folder_of_its_name(
    hub, demo_eager_package, demo_eager_package_v2, tmp_path, monkeypatch
):
    """`hf download org/name --local-dir org/name` puts a folder of the repo's name in the working directory:
    a plain "org/name" is then refused (tests/test_source.py), "hf://org/name" is the repo
    (docs/hub.md, "Naming a package")."""
    hub.publish(demo_eager_package, "xpupack-tests/shadowed")
    monkeypatch.chdir(tmp_path)
    shutil.copytree(demo_eager_package_v2, tmp_path / "xpupack-tests" / "shadowed")
    with pytest.raises(xpupack.AmbiguousSourceError):
        xpupack.load(tiny_transformer(99), "xpupack-tests/shadowed")
    model = xpupack.load(tiny_transformer(99), "hf://xpupack-tests/shadowed")
    torch.testing.assert_close(logits(model), reference(0))  # the repo's weights, not the folder's (seed 7)
    inspected = json.loads(CliRunner().invoke(main, ["inspect", "hf://xpupack-tests/shadowed", "--json"]).stdout)
    assert not inspected["trusted"] and inspected["package"].startswith("xpupack-tests/shadowed@main")
    model = xpupack.load(tiny_transformer(99), "./xpupack-tests/shadowed")
    torch.testing.assert_close(logits(model), reference(7))


# ---------------------------------------------------------------- errors a user can act on


def test_repo_not_found(hub):
    with pytest.raises(xpupack.RepoNotFoundError, match="no repo xpupack-tests/absent") as caught:
        xpupack.load(tiny_transformer(), "xpupack-tests/absent")
    assert "no folder" in str(caught.value) and "token" in str(caught.value)


def test_revision_not_found_lists_the_revisions(hub, demo_eager_package):
    hub.publish(demo_eager_package, "xpupack-tests/no-such-revision")
    with pytest.raises(xpupack.RevisionNotFoundError, match="no revision 'nope'.*main") as caught:
        xpupack.load(tiny_transformer(), "xpupack-tests/no-such-revision", revision="nope")
    assert caught.value.available == ["main"]


def test_repo_without_manifest_is_not_a_package(hub):
    hub.publish(None, "xpupack-tests/not-a-package", extra={"README.md": b"# some other model\n"})
    with pytest.raises(xpupack.PackageFormatError, match="not an xpupack package: it has no xpupack.json"):
        xpupack.load(tiny_transformer(), "xpupack-tests/not-a-package")


def test_repo_lacking_a_listed_file_is_incomplete(hub, demo_eager_package, tmp_path):
    partial = shutil.copytree(demo_eager_package, tmp_path / "partial")
    (partial / "modules" / "layers.1.mlp" / "spec.json").unlink()
    hub.publish(partial, "xpupack-tests/partial")
    with pytest.raises(xpupack.IntegrityError, match="lacks modules/layers.1.mlp/spec.json"):
        xpupack.load(tiny_transformer(), "xpupack-tests/partial")


def test_cli_reports_hub_errors_in_one_line(hub):
    result = CliRunner().invoke(main, ["inspect", "xpupack-tests/absent"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: 'xpupack-tests/absent' names a Hub repo (no folder ")
    assert "Traceback" not in result.output


# ---------------------------------------------------------------- trust (docs/safety.md)


def test_only_a_commit_hash_or_trust_compiled_is_trusted(hub, demo_eager_package):
    repo = "xpupack-tests/trust"
    commit = hub.publish(demo_eager_package, repo)
    hub.tag(repo, "v1", commit)
    assert download(repo, revision=commit).trusted
    assert download(repo, trust_compiled=True).trusted
    for revision in (None, "main", "v1"):
        source = download(repo, revision=revision)
        assert not source.trusted
        assert f"(commit {commit}) is not pinned" in source.trust_reason  # tells the user which commit to pin


def test_inspect_and_verify_by_repo_id_show_trust(hub, demo_eager_package):
    repo = "xpupack-tests/inspect"
    commit = hub.publish(demo_eager_package, repo)
    runner = CliRunner()
    unpinned = json.loads(runner.invoke(main, ["inspect", repo, "--json"]).stdout)
    pinned = json.loads(runner.invoke(main, ["inspect", repo, "--revision", commit, "--json"]).stdout)
    assert (unpinned["trusted"], pinned["trusted"]) == (False, True)
    assert unpinned["package"] == f"{repo}@main (commit {commit[:12]})"
    text = runner.invoke(main, ["inspect", repo]).stdout
    assert "the package has no compiled artifacts, so nothing is rebuilt" in " ".join(text.split())
    verified = runner.invoke(main, ["verify", repo])
    assert verified.exit_code == 0, verified.output
    assert "intact" in verified.stdout


@pytest.mark.slow
def test_unpinned_inductor_package_is_compiled_here(hub, demo_inductor_package, caplog):
    hub.publish(demo_inductor_package, "xpupack-tests/inductor-unpinned")
    with caplog.at_level(logging.INFO, logger="xpupack"):
        model = xpupack.load(tiny_transformer(99), "xpupack-tests/inductor-unpinned")
    assert "is not pinned by commit hash" in caplog.text
    assert "loaded Inductor cache artifacts" not in caplog.text
    assert "not pinned" in session_of(model).modules["layers.0.mlp"].report[0].reason
    torch.testing.assert_close(logits(model), reference(0), rtol=1e-4, atol=1e-4)

    runner = CliRunner()
    text = runner.invoke(main, ["inspect", "xpupack-tests/inductor-unpinned"]).stdout
    assert "compiled artifacts of layers.0.mlp (inductor) will be rebuilt on load" in " ".join(text.split())
    verified = runner.invoke(main, ["verify", "xpupack-tests/inductor-unpinned", "--json"])
    assert verified.exit_code == 2
    assert "not trusted" in json.loads(verified.stdout)["compatibility"]["layers.0.mlp"]["status"]


@pytest.mark.slow
def test_pinned_inductor_package_runs_its_compiled_artifacts(hub, demo_inductor_package, caplog):
    commit = hub.publish(demo_inductor_package, "xpupack-tests/inductor-pinned")
    with caplog.at_level(logging.INFO, logger="xpupack"):
        model = xpupack.load(
            tiny_transformer(99), "xpupack-tests/inductor-pinned", revision=commit, defer_compile=False
        )
    assert "loaded Inductor cache artifacts" in caplog.text
    assert "not pinned" not in caplog.text
    assert session_of(model).modules["layers.0.mlp"].report[0].reason == "from package"
    torch.testing.assert_close(logits(model), reference(0), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- push, at the HfApi boundary


class FakeHfApi:
    """Stands in for the Hub's write API: records each call and what each commit uploads."""

    def __init__(self, existing: list[str] | None = None, refuse: int | None = None):
        self.calls: list[tuple[str, dict]] = []
        self.commits: list[dict] = []
        self.existing = existing or []
        self.refuse = refuse

    def install(self, monkeypatch) -> FakeHfApi:
        for name in ("create_repo", "create_branch", "list_repo_files", "create_commit"):
            fake = getattr(self, "_" + name)
            # a plain function on the class, so that each HfApi instance passes itself as `api`
            monkeypatch.setattr(HfApi, name, lambda api, *args, _fake=fake, **kwargs: _fake(api, *args, **kwargs))
        return self

    def _create_repo(self, api, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        if self.refuse:
            response = httpx2.Response(self.refuse, request=httpx2.Request("POST", f"{api.endpoint}/api/repos/create"))
            raise HfHubHTTPError(f"{self.refuse} Client Error", response=response)

    def _create_branch(self, api, repo_id, **kwargs):
        self.calls.append(("create_branch", {"repo_id": repo_id, **kwargs}))

    def _list_repo_files(self, api, repo_id, **kwargs):
        self.calls.append(("list_repo_files", {"repo_id": repo_id, **kwargs}))
        return list(self.existing)

    def _create_commit(self, api, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", {"repo_id": repo_id, **kwargs}))
        added, deleted = {}, []
        for op in operations:
            if hasattr(op, "path_or_fileobj"):
                source = op.path_or_fileobj
                added[op.path_in_repo] = source if isinstance(source, bytes) else Path(source).read_bytes()
            else:
                deleted.append(op.path_in_repo)
        self.commits.append({"repo_id": repo_id, "added": added, "deleted": deleted, **kwargs})
        oid = f"{len(self.commits):040x}"
        return CommitInfo(
            commit_url=f"{api.endpoint}/{repo_id}/commit/{oid}",
            commit_message=kwargs["commit_message"],
            commit_description="",
            oid=oid,
            _endpoint=api.endpoint,
        )


def test_push_uploads_the_verified_package_and_a_card_in_one_commit(demo_eager_package, monkeypatch):
    fake = FakeHfApi(existing=[".gitattributes"]).install(monkeypatch)
    url = xpupack.push(demo_eager_package, "org/tiny")
    assert [name for name, _ in fake.calls] == ["create_repo", "list_repo_files", "create_commit"]
    assert fake.calls[0][1] == {"repo_id": "org/tiny", "private": None, "exist_ok": True}
    (commit,) = fake.commits
    manifest = read_manifest(demo_eager_package)
    assert set(commit["added"]) == {"xpupack.json", "README.md", *manifest["files"]}
    for name in ("xpupack.json", *manifest["files"]):
        assert commit["added"][name] == (demo_eager_package / name).read_bytes(), name
    assert commit["deleted"] == [] and commit["revision"] is None
    assert commit["commit_message"].startswith("xpupack package: 2 module(s) (eager)")
    card = commit["added"]["README.md"].decode()
    assert card.startswith("---\nlibrary_name: xpupack\ntags:\n- xpupack\n- pytorch\n- cpu\n- eager\n---\n")
    assert 'xpupack.load(model, "org/tiny")' in card
    assert url == url.commit_url and url.commit_url.endswith(f"/org/tiny/commit/{url.oid}")


def test_push_refuses_a_damaged_package(demo_eager_package, tmp_path, monkeypatch):
    fake = FakeHfApi().install(monkeypatch)
    damaged = shutil.copytree(demo_eager_package, tmp_path / "damaged")
    (damaged / "modules" / "layers.0.mlp" / "spec.json").write_text("{}")
    with pytest.raises(xpupack.IntegrityError, match="spec.json"):
        xpupack.push(damaged, "org/tiny")
    assert fake.calls == []


def test_push_to_a_branch_replaces_an_earlier_package(demo_eager_package, monkeypatch):
    """Files of the earlier package go; the repo's own files (a LICENSE, docs) stay (docs/hub.md)."""
    old_files = [
        ".gitattributes",
        "README.md",
        "xpupack.json",
        "modules/old/spec.json",
        "model.safetensors",
        "backends/inductor/cache.bin",
        "LICENSE",
        "docs/usage.md",
    ]
    fake = FakeHfApi(existing=old_files).install(monkeypatch)
    xpupack.push(demo_eager_package, "org/tiny", revision="candidate", private=True)
    assert fake.calls[0][1]["private"] is True
    assert fake.calls[1] == ("create_branch", {"repo_id": "org/tiny", "branch": "candidate", "exist_ok": True})
    (commit,) = fake.commits
    assert commit["revision"] == "candidate"
    assert commit["deleted"] == ["modules/old/spec.json", "backends/inductor/cache.bin"]  # in the same commit
    assert 'xpupack.load(model, "org/tiny", revision="candidate")' in commit["added"]["README.md"].decode()


def test_push_without_write_access_says_how_to_log_in(demo_eager_package, monkeypatch):
    FakeHfApi(refuse=403).install(monkeypatch)
    with pytest.raises(xpupack.HubError, match="refused to write to org/tiny.*hf auth login"):
        xpupack.push(demo_eager_package, "org/tiny")


def test_pushed_package_loads_by_repo_id(hub, demo_eager_package, monkeypatch, tmp_path):
    fake = FakeHfApi().install(monkeypatch)
    xpupack.push(demo_eager_package, "xpupack-tests/pushed")
    uploaded = tmp_path / "uploaded"
    for name, data in fake.commits[0]["added"].items():
        (uploaded / name).parent.mkdir(parents=True, exist_ok=True)
        (uploaded / name).write_bytes(data)
    hub.publish(uploaded, "xpupack-tests/pushed")
    model = xpupack.load(tiny_transformer(99), "xpupack-tests/pushed")
    torch.testing.assert_close(logits(model), reference(0))


def test_cli_push_prints_the_commit_url(demo_eager_package, monkeypatch):
    FakeHfApi().install(monkeypatch)
    result = CliRunner().invoke(main, ["push", str(demo_eager_package), "org/tiny", "--private"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith("/org/tiny/commit/" + "0" * 39 + "1")
    assert 'revision="' + "0" * 39 + '1"' in result.stderr


@pytest.fixture
def listening_port():
    """A loopback port that listens but never answers: any connection to it stays in its backlog."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        yield server


def closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens there once the socket is closed


def test_push_dry_run_shows_the_repo_files_sizes_and_message_and_contacts_nothing(
    demo_eager_package, monkeypatch, listening_port
):
    port = listening_port.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    result = CliRunner().invoke(
        main, ["push", str(demo_eager_package), "org/tiny", "--revision", "candidate", "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    with pytest.raises(BlockingIOError):
        listening_port.accept()  # no connection was ever made
    out = result.output
    manifest = read_manifest(demo_eager_package)
    assert f"repo: org/tiny, branch candidate, on http://127.0.0.1:{port}" in out
    for name in ("xpupack.json", *manifest["files"]):
        size = (demo_eager_package / name).stat().st_size
        assert any(line.split()[:2] == [name, str(size)] for line in out.splitlines()), name
    assert "README.md" in out and "(model card)" in out
    assert "commit message: xpupack package: 2 module(s) (eager)" in out
    assert "dry run: nothing was uploaded" in out


def test_push_plan_is_what_push_commits(demo_eager_package, monkeypatch):
    from xpupack.publish import plan_push

    plan = plan_push(demo_eager_package, "org/tiny")
    fake = FakeHfApi().install(monkeypatch)
    xpupack.push(demo_eager_package, "org/tiny")
    (commit,) = fake.commits
    assert {name: len(data) for name, data in commit["added"].items()} == dict(plan.files)
    assert commit["commit_message"] == plan.commit_message


def test_push_that_cannot_reach_the_hub_names_the_endpoint_it_tried(demo_eager_package, monkeypatch):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(xpupack.HubError, match=f"cannot reach the Hub at {endpoint}.*HF_ENDPOINT") as caught:
        xpupack.push(demo_eager_package, "org/tiny")
    assert caught.value.repo_id == "org/tiny"
    result = CliRunner().invoke(main, ["push", str(demo_eager_package), "org/tiny"])
    assert result.exit_code == 1 and f"error: cannot reach the Hub at {endpoint}" in result.output
    assert "Traceback" not in result.output


# ---------------------------------------------------------------- model card


def test_model_card_describes_modules_environment_and_loading(demo_eager_package):
    manifest = read_manifest(demo_eager_package)
    card = package_card(demo_eager_package, manifest, "org/tiny")
    assert "| `layers.0.mlp` | eager | `(f32[1,16,64])`<br>`(f32[2,16,64])` |" in card
    assert f"| torch | {manifest['environment']['torch']} |" in card
    assert f"| python | {manifest['environment']['python']} |" in card
    assert "xpupack inspect org/tiny" in card
    assert "Compiled artifacts" not in card  # eager has none


@pytest.mark.slow  # an Inductor compile (demo_inductor_package)
def test_model_card_explains_the_trust_rule_for_compiled_artifacts(demo_inductor_package):
    card = package_card(demo_inductor_package, read_manifest(demo_inductor_package), "org/fast")
    assert "- inductor" in card.split("---")[1]
    assert "Compiled artifacts (`layers.0.mlp` (inductor))" in card
    assert "trust_compiled=True" in card


# ---------------------------------------------------------------- pins, extra files (docs/hub.md)


def test_a_revision_that_only_looks_like_a_commit_hash_is_not_a_pin(demo_eager_package, tmp_path, monkeypatch):
    """Trust needs the commit the Hub resolved, not a revision that merely looks like one: a branch or a tag
    can be named with 40 hex digits and moved. (olah cannot serve such a branch, so the Hub client's answer
    is stood in for: the snapshot folder of the commit it resolved.)"""
    lookalike, resolved = "c0ffee" * 6 + "c0ff", "1" * 40
    snapshot = shutil.copytree(demo_eager_package, tmp_path / "snapshots" / resolved)
    asked = []

    def fetch(hub, repo_id, filename, revision, token, **kwargs):
        asked.append(revision)
        return str(snapshot / filename)

    monkeypatch.setattr("xpupack.hub._fetch", fetch)
    source = download("org/name", revision=lookalike)
    assert not source.trusted
    assert f"resolved to commit {resolved}" in source.trust_reason
    assert set(asked[1:]) == {resolved}  # the listed files come from the commit the manifest came from
    assert download("org/name", revision=resolved).trusted


def test_a_repo_with_other_files_loads_after_a_full_snapshot_download(hub, demo_eager_package):
    """`hf download` (snapshot_download) puts the repo's other files in the cache too: they are ignored,
    never read, as for a fresh cache that never fetched them (docs/hub.md)."""
    from huggingface_hub import snapshot_download

    from xpupack.hub import hub_settings

    repo = "xpupack-tests/with-license"
    commit = hub.publish(demo_eager_package, repo, extra={"LICENSE": b"Apache-2.0\n", "docs/usage.md": b"# usage\n"})
    snapshot = Path(snapshot_download(repo, cache_dir=hub_settings().cache_dir, endpoint=hub.endpoint))
    assert (snapshot / "LICENSE").exists() and (snapshot / "README.md").exists()
    for revision in (None, commit):
        model = xpupack.load(tiny_transformer(99), repo, revision=revision)
        torch.testing.assert_close(logits(model), reference(0))
    verified = CliRunner().invoke(main, ["verify", repo, "--revision", commit])
    assert verified.exit_code == 0, verified.output


@pytest.mark.parametrize(
    "revision", ["", "../main", "/main", "main/", "a b", "new\nline", "a..b", "x\x1b[2J", "a:b", ".hidden", "a.lock"]
)
def test_push_refuses_a_revision_that_is_no_branch_name_before_anything(demo_eager_package, monkeypatch, revision):
    """``--revision ""`` and ``--revision ../main`` made a dry run report success (and a push would send them
    to the Hub): a branch name git refuses is a SourceError, in the dry run too."""
    fake = FakeHfApi().install(monkeypatch)
    with pytest.raises(xpupack.SourceError, match="is not a branch name git takes") as caught:
        xpupack.push(demo_eager_package, "org/tiny", revision=revision)
    assert caught.value.source == revision and fake.commits == []
    result = CliRunner().invoke(
        main, ["push", str(demo_eager_package), "org/tiny", "--revision", revision, "--dry-run"]
    )
    assert result.exit_code == 1 and result.stderr.startswith("error: revision=") and "dry run" not in result.output
    assert "\x1b" not in result.output


@pytest.mark.parametrize("revision", ["candidate", "release/v2", "v1.0"])
def test_push_takes_a_branch_name(demo_eager_package, revision):
    result = CliRunner().invoke(
        main, ["push", str(demo_eager_package), "org/tiny", "--revision", revision, "--dry-run"]
    )
    assert result.exit_code == 0 and f"branch {revision}," in result.output
