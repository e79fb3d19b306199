"""The typer app, its global options, and `main`: the CLI boundary where an error becomes one line."""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Memory-bounded high-resolution diffusion: exact tiled VAE, tiled denoising, resolution buckets.\n\n"
    "Runs on the embedded default model unless --model points at a diffusers pipeline folder or a "
    ".safetensors checkpoint (local files only).",
)
STATE = {"debug": False}


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option(help="show tracebacks instead of one-line errors")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False,
) -> None:
    STATE["debug"] = debug
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )


def main() -> None:
    """Entry point: one clear line per error (traceback with --debug); Ctrl-C leaves no partial file."""
    # diffusers imports transformers' image processors, which warn about torchvision on every start
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        app(standalone_mode=False)
    except KeyboardInterrupt:
        typer.echo("interrupted: no partial output was left", err=True)
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as e:  # the CLI boundary: report, never hide
        import click

        if STATE["debug"]:
            raise
        if isinstance(e, click.exceptions.Abort):
            typer.echo("aborted", err=True)
            sys.exit(1)
        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(e.exit_code)
        typer.echo(f"error: {e}", err=True)
        sys.exit(2 if isinstance(e, ValueError) else 1)
