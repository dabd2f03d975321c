"""``xpupack push``: verify a package and upload it to the Hugging Face Hub in one commit."""

from __future__ import annotations

import click

from ._common import handle_errors


@click.command()
@click.argument("package", metavar="DIR", type=click.Path(exists=True, file_okay=False))
@click.argument("repo_id", metavar="ORG/NAME")
@click.option("--revision", default=None, help="Branch to commit to (created from main if missing). Default: main.")
@click.option("--private/--public", default=None,
              help="Visibility of a repo this creates (an existing repo keeps its own). Default: the Hub's.")
@click.option("--token", default=None, help="Token with write access. Default: HF_TOKEN or the stored login.")
@handle_errors
def push(package, repo_id, revision, private, token):
    """Verify the package in DIR and upload it to the Hub repo ORG/NAME in one commit, with a model card.

    DIR is a folder named so that it cannot read as a Hub repo: ./org/name, not org/name.

    Prints the commit URL. Load the package pinned to that commit (the hash at the end of the URL) so
    that its compiled artifacts run: xpupack.load(model, "ORG/NAME", revision="<commit hash>").
    """
    from ..publish import push as push_package

    info = push_package(package, repo_id, revision=revision, private=private, token=token)
    click.echo(info.commit_url)
    click.echo(f'load it pinned to this commit: xpupack.load(model, "{repo_id}", revision="{info.oid}")', err=True)
