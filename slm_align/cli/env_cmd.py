"""``slm-align env``: the environment in one report, to paste into a bug report; ``--version``."""

from __future__ import annotations

from functools import partial

import typer

from slm_align.cli.options import JsonFlag
from slm_align.cli.render import emit, stdout

commands = typer.Typer()


def print_version(given: bool) -> None:
    """The ``--version`` callback: print the version and stop."""
    if given:
        from slm_align.cli.env_report import slm_align_version

        stdout.print(f"slm-align {slm_align_version()}", highlight=False)
        raise typer.Exit(0)


def _shown(value) -> str:
    if value is None:
        return "not installed"
    return str(value)


def print_environment(report: dict) -> None:
    """The report as ``name: value`` lines, one section per runtime."""
    lines = [f"slm-align {report['slm_align']}, Python {report['python']}, {report['platform']}"]
    cpu = report["cpu"]
    lines.append(f"CPU: {cpu['name']} ({cpu['machine']}), {cpu['cores']} cores / "
                 f"{cpu['logical_cpus']} logical, {cpu['ram_gb']} GiB RAM; features: "
                 f"{' '.join(cpu['features']) or 'none found'}")
    torch_info = report["torch"]
    if torch_info is not None:
        lines.append(f"torch: {torch_info['threads']} threads, {torch_info['interop_threads']} "
                     f"interop threads, CPU kernels {torch_info['cpu_capability']}")
    llama_info = report["llama_cpp"]
    if llama_info is not None:
        lines.append(f"llama.cpp: {llama_info['system_info']}")
    if report["onnxruntime_providers"] is not None:
        lines.append(f"onnxruntime providers: {', '.join(report['onnxruntime_providers'])}")
    lines.append(f"accelerators: {', '.join(report['accelerators']) or 'none (CPU only)'}")
    lines.append("packages:")
    lines.extend(f"  {name} {_shown(version)}" for name, version in report["packages"].items())
    stdout.print("\n".join(lines), highlight=False, markup=False, soft_wrap=True)


@commands.command(epilog="Examples:\n\n  slm-align env\n\n  slm-align env --json > env.json   # "
                  "attach to a bug report")
def env(as_json: bool = JsonFlag) -> None:
    """Versions of every dependency, torch threads, CPU features, llama.cpp's build and
    the accelerators found."""
    from slm_align.cli.env_report import collect_environment

    report = collect_environment()
    emit(as_json, report, partial(print_environment, report))
