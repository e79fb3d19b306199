"""The kinds of failure tilewise tells apart, each with the exit status of the `tilewise` command.

| kind            | exit | what it means                                                                    |
|-----------------|------|----------------------------------------------------------------------------------|
| (success)       | 0    | the command did what it was asked and its outputs are complete                   |
| internal        | 1    | anything not named below: a bug, or a system error tilewise did not foresee      |
| bad request     | 2    | an option or argument is invalid (a value, a combination, a path that is not     |
|                 |      | there, an output tilewise cannot write or must not replace)                      |
| bad input file  | 3    | an input file exists but cannot be used: corrupt, truncated, a folder, not an    |
|                 |      | image or latents file, an image kind tilewise does not read, NaN latents          |
| won't fit       | 4    | the work needs more memory or disk than there is (refused before it starts, or   |
|                 |      | an out-of-memory error or full disk while it runs)                               |
| model problem   | 5    | the model exists but cannot be loaded or used (malformed model_index.json,        |
|                 |      | missing or broken weights, a checkpoint that does not fit its config)            |
| some failed     | 6    | a batch job (`generate --prompts`, `upscale DIR`) made its other items, but some |
|                 |      | failed: each is listed with its reason; a rerun retries only those               |
| interrupted     | 130  | SIGINT (Ctrl-C): stopped, partial outputs removed                                 |
|                 | 143  | SIGTERM: the same clean-up; 129 for SIGHUP                                       |

The exceptions are ValueErrors (the library refuses bad input with a ValueError naming the value), so
`except ValueError` keeps working; `Interrupted` is a BaseException like KeyboardInterrupt.
"""

from __future__ import annotations

import signal


class TilewiseError(Exception):
    """Base of the failures tilewise names; `kind` and `exit_code` say which (see the module table)."""

    kind = "internal"
    exit_code = 1


class BadRequest(TilewiseError, ValueError):
    """An option or argument is invalid: its value, a combination, a path that is not there, an output."""

    kind = "bad request"
    exit_code = 2


class BadInputFile(TilewiseError, ValueError):
    """An input file exists but cannot be used: corrupt, truncated, a folder, of a kind not read here."""

    kind = "bad input file"
    exit_code = 3


class WontFit(TilewiseError, ValueError):
    """The work needs more memory or disk than there is; the message gives the figure and what fits."""

    kind = "won't fit"
    exit_code = 4


class ModelProblem(TilewiseError, ValueError):
    """The model exists but cannot be loaded or used."""

    kind = "model problem"
    exit_code = 5


class SomeFailed(TilewiseError):
    """A batch job made its other items, but some failed (each listed with its reason)."""

    kind = "some failed"
    exit_code = 6


class Interrupted(BaseException):
    """A signal (SIGINT, SIGTERM, SIGHUP) stopped the run; raised by the CLI's handlers so that every
    `finally` and `with` on the way out runs (temporary files and staging folders are removed)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = int(signum)
        self.exit_code = 128 + self.signum

    @property
    def name(self) -> str:
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    def __str__(self) -> str:
        return f"interrupted by {self.name}"


EXIT_CODES = {"success": 0, "internal": TilewiseError.exit_code, "bad request": BadRequest.exit_code,
              "bad input file": BadInputFile.exit_code, "won't fit": WontFit.exit_code,
              "model problem": ModelProblem.exit_code, "some failed": SomeFailed.exit_code,
              "interrupted (SIGINT)": 128 + signal.SIGINT, "terminated (SIGTERM)": 128 + signal.SIGTERM}

__all__ = ["EXIT_CODES", "BadInputFile", "BadRequest", "Interrupted", "ModelProblem", "SomeFailed",
           "TilewiseError", "WontFit"]
