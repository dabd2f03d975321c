"""The model card (``README.md``) of a package, for the Hugging Face Hub."""

from __future__ import annotations


def model_card(manifest: dict, signatures: dict[str, list[str]] | None = None,
               repo_id: str | None = None) -> str:
    """A model card with YAML front matter (``library_name: xpupack``, tags) and a module table."""
    signatures = signatures or {}
    env = manifest["environment"]
    backends = sorted({m["backend"]["name"] for m in manifest["modules"]})
    tags = ["xpupack", env["device_type"], *backends]
    lines = ["---", "library_name: xpupack", "tags:", *[f"- {tag}" for tag in dict.fromkeys(tags)], "---", ""]
    lines += [f"# {manifest['model']['class'].rsplit('.', 1)[-1]} tuned with xpupack", "",
              f"Built on {env['device_name']} ({env['device_type']}) with torch {env['torch']} and "
              f"xpupack {manifest['xpupack_version']}, {manifest['created']}.", "",
              "| module | backend | recorded signatures |", "| --- | --- | --- |"]
    for module in manifest["modules"]:
        shapes = "<br>".join(f"`{s}`" for s in signatures.get(module["path"], [])) or "—"
        lines.append(f"| `{module['path'] or '<model>'}` | {module['backend']['name']} | {shapes} |")
    source = repo_id or "path/to/this/package"
    lines += ["", "## Load it", "", "```python", "import xpupack", "",
              "model = make_model()  # the same architecture this package was built from",
              f'model = xpupack.load(model, "{source}")', "```", "",
              "Calls whose inputs do not match a recorded signature run the original module.", ""]
    return "\n".join(lines)
