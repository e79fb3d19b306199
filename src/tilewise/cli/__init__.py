"""The `tilewise` command: a thin typed layer over the library (typer). Errors print one line; --debug
shows the traceback. Outputs are written under a temporary name and renamed when complete.

One module per command group: `generate` (generate, upscale), `vae` (decode, encode), `plan`, `measure`
(analyze, compare), `buckets`, `report` (the run folder and the report command). `entry` holds the app and
the error boundary, `options` the typed options the commands share, `ranks` the --nproc launch.
"""

from . import buckets, generate, measure, plan, report, vae
from .entry import app, main

# registered here, in one place: this order is the order of `tilewise --help`
COMMANDS = (generate.generate, generate.upscale, vae.decode, vae.encode, measure.analyze, plan.plan,
            measure.compare, buckets.buckets, report.report)
for _command in COMMANDS:
    app.command()(_command)

__all__ = ["app", "main"]
