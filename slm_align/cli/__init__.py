"""The ``slm-align`` command line. Thin: parse, call one function, print.

Commands live by job: ``train`` (training stages), ``export`` (merge, export), ``runtime``
(chat, serve, feedback), ``devices`` (profiles, bench); ``render`` prints for people and
``options`` builds shared options.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import typer
from typer.exceptions import TyperException

from slm_align.cli import bundle, config_cmd, devices, env_cmd, export, field, runtime, tasks, train
from slm_align.cli.aliases import current_spellings
from slm_align.errors import EXIT_USER_ERROR, UserError, storage_error

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help="Align small language models safely and ship them to phones and CPU boards.")
app.add_typer(train.commands)
app.add_typer(export.commands)
app.add_typer(bundle.commands)
app.add_typer(runtime.commands)
app.add_typer(devices.commands)
app.add_typer(tasks.commands)
app.add_typer(env_cmd.commands)
app.add_typer(runtime.feedback_app, name="feedback")
app.add_typer(field.field_app, name="field")
app.add_typer(devices.devices_app, name="devices")
app.add_typer(config_cmd.config_app, name="config")


QUIET_HELP = ("Print nothing but errors: no progress bars or lines, no summaries (the exit code "
              "and the run's files say how it went).")


@app.callback()
def root(version: bool = typer.Option(False, "--version", is_eager=True, callback=env_cmd.print_version,
                                      help="Print slm-align's version and exit."),
         quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_HELP)) -> None:
    """Align small language models safely and ship them to phones and CPU boards."""
    from slm_align.cli.render import stdout
    from slm_align.progress import set_quiet

    set_quiet(quiet)  # every invocation decides afresh (tests run many in one process)
    stdout.quiet = quiet


def quiet_first(args: list[str]) -> list[str]:
    """``--quiet`` is a root option; accept it after the command too
    (``slm-align train ... --quiet``)."""
    if "--quiet" not in args:
        return args
    return ["--quiet"] + [arg for arg in args if arg != "--quiet"]


def _usage_error(exc: TyperException) -> int:
    """Report a parser error (unknown option, bad value, missing argument) in
    one line; the exit code."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # the parser has already printed the help
        return 0
    ctx = getattr(exc, "ctx", None)
    hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    sys.stderr.write(f"error: {' '.join(exc.format_message().split())}{hint}\n")
    return EXIT_USER_ERROR


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: user errors become one line on stderr and exit code 2;
    bugs keep their traceback."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # our messages, not library advisories
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = quiet_first(current_spellings(sys.argv[1:] if argv is None else argv, sys.stderr.write))
    try:
        code = _run(args)
    finally:
        _speak_again()
    sys.exit(code if isinstance(code, int) else 0)


def _run(args: list[str]):
    """Run the command line ``args``; its exit code (user errors, full disks and
    usage errors as one line)."""
    try:
        return typer.main.get_command(app).main(args=args, prog_name="slm-align", standalone_mode=False)
    except UserError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return exc.exit_code
    except OSError as exc:  # a full disk or a permission: one line, not a traceback
        error = storage_error(exc)
        if error is None:
            raise
        sys.stderr.write(f"error: {error}\n")
        return error.exit_code
    except TyperException as exc:  # usage errors of the parser (unknown option, bad value, missing argument)
        return _usage_error(exc)
    except typer.Abort:
        sys.stderr.write("aborted\n")
        return 130
    except typer.Exit as exc:
        return exc.exit_code


def _speak_again() -> None:
    """Undo ``--quiet`` once the command is over: the consoles are module-wide, and an
    embedding program or a test that calls :func:`main` again, or prints through them
    directly, would stay silenced."""
    from slm_align.cli.render import stdout
    from slm_align.progress import set_quiet

    set_quiet(False)
    stdout.quiet = False
