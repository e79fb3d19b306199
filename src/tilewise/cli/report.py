"""The run folder a command writes with --report (run.json, plan.json, pictures) and the `report` command."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from ..atomic import write_text


def run_folder(report: Path | None, info: dict) -> Path | None:
    """Create the --report folder with its run.json; None without --report."""
    if report is None:
        return None
    report.mkdir(parents=True, exist_ok=True)
    write_text(report / "run.json", json.dumps(info, indent=2, default=str))
    return report


def write_plan(run_dir: Path | None, plan) -> None:
    """The plan as plan.json in the run folder."""
    if run_dir is None or plan is None:
        return
    write_text(run_dir / "plan.json", json.dumps(asdict(plan), indent=2, default=str))


def finish_report(run_dir: Path | None) -> None:
    """Build the HTML report of the run folder and print where it is."""
    if run_dir is None:
        return
    from ..report import build_report  # (lazy: not on the path of `tilewise --help`)

    typer.echo(f"report: {build_report(run_dir)}")


def report(run_dir: Annotated[Path, typer.Argument(help="a run folder written with --report")]) -> None:
    """Build the self-contained HTML report of a run folder (plan, pictures, errors, cost instrument).

    Example: tilewise report runs/wide
    """
    finish_report(run_dir)
