"""The model card (``README.md``) of a package, for the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path

from .manifest import read_spec

_ENVIRONMENT_ROWS = (
    ("xpupack", "xpupack"),
    ("torch", "torch"),
    ("torchao", "torchao"),
    ("triton", "triton"),
    ("python", "python"),
    ("device type", "device_type"),
    ("device", "device_name"),
    ("architecture", "architecture"),
    ("driver", "driver"),
)


def model_card(
    manifest: dict,
    signatures: dict[str, list[str]] | None = None,
    repo_id: str | None = None,
    *,
    revision: str | None = None,
) -> str:
    """A model card: YAML front matter, modules, build environment and how to load the package.

    The front matter has ``library_name: xpupack`` and tags for the device type
    and the backends, so the Hub lists the package under xpupack and lets
    people filter by them.

    Args:
        manifest: the package's validated manifest.
        signatures: ``{module path: [short signature, ...]}`` (see `package_card`).
        repo_id: the Hub repo the card is for; the loading example uses it.
        revision: the branch the package is pushed to, when not ``main``.

    Returns:
        The card's Markdown text.
    """
    from .report import backend_label, compiled_backends, quantization

    signatures = signatures or {}
    env = manifest["environment"]
    backends = sorted({m["backend"]["name"] for m in manifest["modules"]})
    quantized = {m["path"]: q for m in manifest["modules"] if (q := quantization(m["backend"]))}
    tags = ["xpupack", "pytorch", env["device_type"], *backends, *(["torchao"] if quantized else [])]
    model_class = manifest["model"]["class"]
    lines = [
        "---",
        "library_name: xpupack",
        "tags:",
        *[f"- {tag}" for tag in dict.fromkeys(tags)],
        "---",
        "",
        f"# {model_class.rsplit('.', 1)[-1]} tuned with xpupack",
        "",
        f"An xpupack package of `{model_class}`: "
        f"{len(manifest['modules'])} tuned module(s), built on {env['device_type']} "
        f"({env['device_name']}) on {manifest['created']}.",
        "",
        "## Modules",
        "",
        "| module | backend | recorded signatures |",
        "| --- | --- | --- |",
    ]
    for module in manifest["modules"]:
        shapes = "<br>".join(f"`{_cell(s)}`" for s in signatures.get(module["path"], [])) or "—"
        lines.append(f"| `{module['path'] or '<model>'}` | {_cell(backend_label(module['backend']))} | {shapes} |")
    lines += ["", "Calls whose inputs match no recorded signature run the original module."]
    if quantized:
        lines += [
            "",
            f"Quantized with TorchAO: {_modules_with(quantized)}. Their weights are stored quantized and load as such "
            "(no `quantize_` at load, no pickle); their outputs differ from the original model's within "
            "the signal-to-noise floor the package was checked against.",
        ]
    lines += [
        "",
        "## Build environment",
        "",
        "| | |",
        "| --- | --- |",
    ]
    lines += [f"| {label} | {_cell(str(env[key]))} |" for label, key in _ENVIRONMENT_ROWS if env.get(key)]
    lines += _how_to_load(repo_id, revision, compiled_backends(manifest))
    return "\n".join(lines) + "\n"


def package_card(root: Path, manifest: dict, repo_id: str | None = None, *, revision: str | None = None) -> str:
    """The model card of the package at ``root``, signatures read from its specs."""
    from .report import describe_signature

    signatures = {
        entry["path"]: [describe_signature(s) for s in read_spec(root, entry)["signatures"]]
        for entry in manifest["modules"]
    }
    return model_card(manifest, signatures, repo_id, revision=revision)


def _modules_with(what: dict[str, str]) -> str:
    """Each module path, in backticks, with what it has in parentheses, for a sentence of the card."""
    return ", ".join(f"`{path or '<model>'}` ({value})" for path, value in what.items())


def _how_to_load(repo_id: str | None, revision: str | None, compiled: dict[str, str]) -> list[str]:
    source = repo_id or "path/to/this/package"
    at_revision = f', revision="{revision}"' if revision else ""
    lines = [
        "",
        "## Load it",
        "",
        "```python",
        "import xpupack",
        "",
        "model = make_model()  # the same architecture and dtype this package was built from",
        f'model = xpupack.load(model, "{source}"{at_revision})',
        "```",
        "",
        "The loader checks every file's sha256 and the model's architecture before it changes anything, "
        "then restores each module on the device it runs on.",
    ]
    if compiled:
        lines += [
            "",
            f"Compiled artifacts ({_modules_with(compiled)}) are native code. From the Hub they run only when the "
            'revision is pinned by a full commit hash (`revision="<commit hash>"`) or with '
            "`trust_compiled=True`; otherwise they are compiled again on your machine.",
        ]
    if repo_id:
        lines += [
            "",
            f"Without loading a model: `xpupack inspect {repo_id}` shows modules, backends and "
            f"signatures; `xpupack verify {repo_id}` checks the files and compatibility with your machine.",
        ]
    return lines


def _cell(text: str) -> str:
    """Text that cannot break a Markdown table row."""
    return text.replace("|", "\\|").replace("\n", " ")
