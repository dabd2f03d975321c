"""``xpupack push``: verify a package and upload it to the Hugging Face Hub in one commit."""

from __future__ import annotations

import click

from ._common import byte_size, handle_errors, printable


@click.command()
@click.argument("package", metavar="DIR", type=click.Path(exists=True, file_okay=False))
@click.argument("repo_id", metavar="ORG/NAME")
@click.option("--revision", default=None, help="Branch to commit to (created from main if missing). Default: main.")
@click.option(
    "--private/--public",
    default=None,
    help="Visibility of a repo this creates (an existing repo keeps its own). Default: the Hub's.",
)
@click.option("--token", default=None, help="Token with write access. Default: HF_TOKEN or the stored login.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Verify the package and print the repo, the files with their sizes and the commit message; "
    "contact nothing, upload nothing.",
)
@handle_errors
def push(package, repo_id, revision, private, token, dry_run):
    """Verify the package in DIR and upload it to the Hub repo ORG/NAME in one commit, with a model card.

    DIR is a folder named so that it cannot read as a Hub repo: ./org/name, not org/name.

    Prints the commit URL. Load the package pinned to that commit (the hash at the end of the URL) so
    that its compiled artifacts run: xpupack.load(model, "ORG/NAME", revision="<commit hash>").
    """
    from ..publish import plan_push
    from ..publish import push as push_package

    if dry_run:
        _print_plan(plan_push(package, repo_id, revision=revision))
        return
    info = push_package(package, repo_id, revision=revision, private=private, token=token)
    click.echo(info.commit_url)
    click.echo(f'load it pinned to this commit: xpupack.load(model, "{repo_id}", revision="{info.oid}")', err=True)


def _print_plan(plan) -> None:
    from ..manifest import MODEL_CARD

    branch = printable(plan.revision or "main", markup=False)
    click.echo(f"repo: {plan.repo_id}, branch {branch}, on {plan.endpoint} (created if missing)")
    click.echo(f"files ({len(plan.files)}, {byte_size(sum(size for _, size in plan.files))} in all):")
    names = [printable(name, markup=False) for name, _ in plan.files]  # the package's own file names
    width = max(map(len, names))
    for name, (listed, size) in zip(names, plan.files):
        card = "  (model card)" if listed == MODEL_CARD else ""
        click.echo(f"  {name:<{width}}  {size:>10}  {byte_size(size)}{card}")
    click.echo(f"commit message: {printable(plan.commit_message, markup=False)}")
    click.echo("files of an earlier package in the repo that this one lacks are deleted in the same commit")
    click.echo("dry run: nothing was uploaded, and the Hub was not contacted")
