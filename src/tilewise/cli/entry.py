"""The typer app, its global options, and `main`: the CLI boundary where an error becomes one line."""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated

import typer

from .failures import report, signals_raise

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


def main(argv: list[str] | None = None) -> None:
    """Entry point: one clear line per error (traceback with --debug) and the exit status of its kind
    (`tilewise.errors`); SIGINT / SIGTERM / SIGHUP leave no partial file and exit 130 / 143 / 129."""
    # diffusers imports transformers' image processors, which warn about torchvision on every start
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = list(sys.argv[1:] if argv is None else argv)
    STATE["debug"] = "--debug" in args[: next((i for i, a in enumerate(args) if not a.startswith("-")),
                                              len(args))]
    try:
        with signals_raise():
            code = app(args=args, standalone_mode=False)  # returns Exit codes instead of raising them
    except SystemExit:
        raise
    except BaseException as e:  # the CLI boundary: report, never hide
        code = report(e, args, STATE["debug"])
    sys.exit(code if isinstance(code, int) else 0)
