"""Commands around an exported model at run time: chat, serve, and exporting the
feedback they collect."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console

from slm_align.cli.options import CallThresholdOpt, ChatTemplateOpt, CtxOpt, JsonFlag, ThreadsOpt, typed_flags
from slm_align.cli.render import emit, print_feedback_export, print_fleet_ab, print_serving
from slm_align.errors import UserError
from slm_align.ondevice.agent.settings import Sampling, check_call_threshold

commands = typer.Typer()
feedback_app = typer.Typer(help="On-device preferences: export or collect them for the next round; decide a "
                                "fleet's A/B test.", no_args_is_help=True)


@commands.command(epilog="Examples:\n\n  slm-align chat runs/demo/export/model-Q8_0.gguf --store "
                         "prefs.db --consent\n\n  slm-align chat runs/demo/export/onnx-int8 "
                         "--system 'You are terse.' --tools --temperature 0\n\n  echo 'hello' | "
                         "slm-align chat model.gguf --json   # one answer per input line, as "
                         "JSON\n\n  slm-align chat gemma-3-270m.gguf --chat-template chatml   # a "
                         "base model: give it a template\n\n  slm-align chat gemma-3-270m.gguf "
                         "--raw   # or continue each line as plain text\n\n  slm-align chat "
                         "runs/demo/export/base-F16.gguf --adapter runs/demo/export/adapter-sft-F16.gguf"
                         "   # a round shipped as an adapter\n\nIn the chat: /good /bad "
                         "/compare /pick 1|2 /edit TEXT /tools /reset /save FILE /quit")
@typed_flags(Sampling, "sampling", renamed={"max_tokens": "--max-new-tokens"})
def chat(
    artifact: Path = typer.Argument(..., help="Exported model: a .gguf file or an "
                                              "ONNX export directory."),
    adapter: Optional[list[Path]] = typer.Option(None, "--adapter", help="LoRA adapter GGUF to apply to "
                                                 "the GGUF base, made for it (`export --target "
                                                 "gguf-adapter`); repeat in the manifest's order."),
    store: Optional[Path] = typer.Option(None, "--store", help="Preference database (SQLite) to record turns in."),
    consent: bool = typer.Option(False, "--consent", help="Mark recorded turns as "
                                                          "consented for training."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    tools: bool = typer.Option(False, "--tools", help="Offer the built-in tools "
                                                      "(calculator, clock, notes)."),
    notes: Optional[Path] = typer.Option(None, "--notes", help="Folder the notes tool "
                                                               "may use (with --tools)."),
    device: Optional[str] = typer.Option(None, "--device", help="Device profile for threads and context."),
    threads: Optional[int] = ThreadsOpt,
    n_ctx: Optional[int] = CtxOpt,
    sampling: Optional[Sampling] = None,
    call_threshold: Optional[float] = CallThresholdOpt,
    chat_template: Optional[str] = ChatTemplateOpt,
    raw: bool = typer.Option(False, "--raw", help="Plain completion (base models): each line is "
                             "continued as text, no template, no tools, nothing recorded."),
    as_json: bool = JsonFlag,
) -> None:
    """Chat with an exported model in the terminal; give feedback that lands
    in the preference store."""
    from slm_align.ondevice.agent.runtime import Agent
    from slm_align.ondevice.agent.terminal import chat_loop, raw_loop
    from slm_align.ondevice.templates.artifact import check_chat_template
    from slm_align.ondevice.templates.chat import require_template
    from slm_align.ondevice.tools.builtin import default_tools

    if raw:
        refuse_with_raw(chat_template=chat_template, store=store, system=system, tools=tools)
    check_call_threshold(call_threshold)
    chosen = replace(sampling.params(), call_threshold=call_threshold)
    agent = Agent.load(artifact, device=device, threads=threads, n_ctx=n_ctx, store=store, consent=consent,
                       system=system, tools=default_tools(notes) if tools else None, sampling=chosen,
                       chat_template=chat_template, adapters=adapter or ())
    if not raw:
        require_template(agent.backend.chat_template)
        check_chat_template(agent.backend)  # a template that loops or fails: one line now, not a hang later
    if as_json:
        answer_lines(agent, raw)
        return
    err = Console(stderr=True)
    loop = raw_loop if raw else chat_loop
    loop(agent, typed_lines(err), say=lambda text: err.print(text, markup=False, highlight=False), write=write_now)


def refuse_with_raw(**given) -> None:
    """--raw continues plain text: a flag that needs a chat (a template, a store, a system prompt,
    tools) is an error, not silently ignored."""
    for name, value in given.items():
        if value:
            flag = name.replace("_", "-")
            raise UserError(f"--raw continues plain text without a chat; --{flag} needs a "
                            "chat: drop one of them")


def answer_lines(agent, raw: bool = False) -> None:
    """One JSON answer on stdout per non-empty line of stdin (with ``raw``,
    its plain continuation)."""
    answer = agent.complete if raw else agent.stream
    for line in (line.strip() for line in sys.stdin):
        if line:
            for _ in answer(line):
                pass
            reply = agent.last
            sys.stdout.write(json.dumps({"reply": reply.text, "tool_calls": reply.tool_calls,
                                         "turn_id": reply.turn_id, "turn_token": reply.turn_token,
                                         "truncated": reply.truncated}) + "\n")


def typed_lines(err: Console) -> Iterator[str]:
    """The lines the user types, each after a ``you>`` prompt on stderr, until end of input."""
    while True:
        err.print("[bold]you>[/] ", end="")
        line = sys.stdin.readline()
        if line == "":
            return
        yield line


def write_now(text: str) -> None:
    """Write streamed answer text to stdout at once."""
    sys.stdout.write(text)
    sys.stdout.flush()


@commands.command(epilog="Examples:\n\n  slm-align serve runs/demo/export/model-Q8_0.gguf --store "
                         "prefs.db --consent   # open http://127.0.0.1:8080/\n\n  "
                         "SLM_ALIGN_API_KEY=s3cret slm-align serve model.gguf --host 0.0.0.0 "
                         "--port 9000\n\n  curl -s http://127.0.0.1:8080/v1/chat/completions -H "
                         "'Content-Type: application/json' -d '{\"model\": \"m\", \"messages\": "
                         "[{\"role\": \"user\", \"content\": \"Hi\"}]}'\n\n  slm-align serve base-F16.gguf "
                         "--store prefs.db --adapter sft=adapter-sft-F16.gguf --candidate adapter-dpo-F16.gguf"
                         "   # A/B a new round\n\nAny OpenAI client "
                         "works: base_url http://127.0.0.1:8080/v1, api_key the "
                         "--api-key (or any text).")
def serve(
    artifact: Path = typer.Argument(..., help="Exported model: a .gguf file or an "
                                              "ONNX export directory."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; beyond "
                                                         "loopback it needs --api-key."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port to listen on (0: any free one)."),
    store: Optional[Path] = typer.Option(None, "--store", help="Preference database (SQLite) "
                                                               "for turns and feedback."),
    consent: bool = typer.Option(False, "--consent", help="Mark recorded turns as "
                                                          "consented for training."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SLM_ALIGN_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1 "
                                               "(env SLM_ALIGN_API_KEY)."),
    tools: bool = typer.Option(False, "--tools", help="Run the built-in tools "
                                                      "(calculator, clock) on the server."),
    device: Optional[str] = typer.Option(None, "--device", help="Device profile for threads and context."),
    threads: Optional[int] = ThreadsOpt,
    n_ctx: Optional[int] = CtxOpt,
    insecure: bool = typer.Option(False, "--insecure", help="Allow listening beyond "
                                                            "loopback without an API key."),
    allow_host: list[str] = typer.Option([], "--allow-host", help="Without --api-key, also answer "
                                         "requests addressed to this host name (repeatable; '*': "
                                         "any). Loopback names always work."),
    chat_template: Optional[str] = ChatTemplateOpt,
    adapter: Optional[list[str]] = typer.Option(None, "--adapter", help="NAME=FILE: a LoRA adapter GGUF made "
                                                "for the GGUF base, answering requests whose 'model' is NAME "
                                                "(repeat a NAME to chain adapters in order); the first NAME is "
                                                "the default."),
    candidate: Optional[list[Path]] = typer.Option(None, "--candidate", help="LoRA adapter GGUF to A/B-test "
                                                   "against the default on the users' thumbs (needs --store); "
                                                   "it promotes or reverts itself. Repeat to chain."),
    candidate_share: float = typer.Option(0.5, "--candidate-share", help="Share of conversations the "
                                          "candidate answers while the A/B test collects."),
    batch: int = typer.Option(8, "--batch", help="Requests of a GGUF model decoded together in one llama.cpp "
                              "context (1: one at a time; ONNX models and adapter sets answer one at a time)."),
    call_threshold: Optional[float] = CallThresholdOpt,
    as_json: bool = JsonFlag,
) -> None:
    """Serve an exported model: an OpenAI-compatible API (/v1/chat/completions, and /v1/completions
    for plain text) and a chat page with feedback."""
    from slm_align.ondevice.agent.server import serve as run_server

    run_server(artifact, host=host, port=port, api_key=api_key, insecure=insecure, store_path=store, consent=consent,
               tools=tools, device=device, threads=threads, n_ctx=n_ctx, allowed_hosts=allow_host,
               chat_template=chat_template, adapters=named_adapters(adapter or ()), candidate=candidate or (),
               candidate_share=candidate_share, batch=batch, call_threshold=call_threshold,
               announce=lambda info: emit(as_json, info, lambda: print_serving(info)))


def named_adapters(values: list[str]) -> dict[str, list[Path]]:
    """``--adapter NAME=FILE`` values as ``{NAME: [FILE, ...]}`` in the order given (one line if one has no
    ``=``)."""
    named: dict[str, list[Path]] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--adapter {value!r}: pass NAME=FILE, e.g. --adapter dpo=adapter-dpo-F16.gguf")
        named.setdefault(name, []).append(Path(path))
    return named


@feedback_app.command("export", epilog="Examples:\n\n  slm-align feedback export prefs.db --out "
                                        "round2.jsonl\n\n  slm-align train --stage reward --out "
                                        "runs/round2 --preferences round2.jsonl --preferences "
                                        "round2.unpaired.jsonl")
def feedback_export(
    db: Path = typer.Argument(..., help="Preference database written by the agent "
                                        "(chat, serve, Python API)."),
    out: Path = typer.Option(..., "--out", "-o", help="Pairs file (.jsonl); thumbs go to "
                                                      "OUT's .unpaired.jsonl."),
    scrub: bool = typer.Option(True, "--scrub/--no-scrub",
                               help="Replace e-mails, phone numbers, cards, SSNs, IPs (v4 and v6), "
                                    "IBANs, API keys and tokens in every string of every row (on "
                                    "by default). Not caught: names, street addresses and other "
                                    "personal data without a fixed shape: read the "
                                    "rows before sharing them."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing output files."),
    as_json: bool = JsonFlag,
) -> None:
    """Write consented feedback as TRL rows: pairs {prompt, chosen, rejected} and unpaired
    {prompt, completion, label}."""
    from slm_align.ondevice.agent.feedback_export import export_preferences

    result = export_preferences(db, out, scrub=scrub, overwrite=overwrite)
    emit(as_json, result, lambda: print_feedback_export(result, scrub))


@feedback_app.command("ab", epilog="Examples:\n\n  slm-align feedback ab devices/*/prefs.db\n\n"
                                    "  slm-align feedback ab a.db b.db --candidate 3f2a... --json\n\n"
                                    "  slm-align feedback ab prefs.db --observations device-17.ab.jsonl"
                                    "   # a device's evidence, no text")
def feedback_ab(
    stores: list[Path] = typer.Argument(..., help="Preference stores of the devices (or servers) that ran the "
                                                  "A/B test; each is one device."),
    candidate: Optional[str] = typer.Option(None, "--candidate", help="The candidate's model_id, when the stores "
                                                                     "hold trials of several candidates."),
    max_per_device: int = typer.Option(20, "--max-per-device", help="Most conversations one device counts with "
                                                                    "(below the minimum of 40: one device alone "
                                                                    "never decides)."),
    observations: Optional[Path] = typer.Option(None, "--observations", help="With one store: also write its A/B "
                                                "observations (no text) to this new file, which a fleet decision "
                                                "reads like the store."),
    as_json: bool = JsonFlag,
) -> None:
    """Decide an A/B test for a fleet: every device's routed conversations pooled into one sequential test,
    each device's weight capped (promote, revert, keep, or collecting)."""
    from slm_align.ondevice.agent.ab_fleet import fleet_decision, write_observations

    if observations is not None and len(stores) != 1:
        raise UserError("--observations writes one device's evidence: pass one store with it")
    result = fleet_decision(stores, candidate, max_per_device)
    if observations is not None:
        result["observations"] = {"out": str(observations), "rows": write_observations(stores[0], observations)}
    emit(as_json, result, lambda: print_fleet_ab(result))


@feedback_app.command("collect", epilog="Examples:\n\n  slm-align feedback collect fleet/*.db --out "
                                         "round2\n\n  slm-align feedback collect phone-1.db phone-2.jsonl "
                                         "phone-2.unpaired.jsonl --out round2 --max-rows-per-device 200 "
                                         "--json")
def feedback_collect(
    inputs: list[Path] = typer.Argument(..., help="Devices' preference stores and `feedback export` files "
                                                  "(.jsonl); each file's name up to its first dot names "
                                                  "its device."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for the next round's rows: pairs.jsonl, "
                                                      "unpaired.jsonl, tasks.jsonl, "
                                                      "demonstrations.jsonl, Parquet shards, "
                                                      "summary.json."),
    max_rows_per_device: int = typer.Option(1000, "--max-rows-per-device",
                                            help="A device's most rows (first come, first kept): one "
                                                 "device cannot make a round."),
    shard_rows: int = typer.Option(50_000, "--shard-rows", min=1, help="Most rows per Parquet shard."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out folder."),
    as_json: bool = JsonFlag,
) -> None:
    """Merge many devices' feedback into the next round: consented rows only, scrubbed again, one row
    per device and turn, each device capped, each row with its device, model_id and arm."""
    from slm_align.ondevice.agent.feedback_collect import collect_feedback, summary_lines

    summary = collect_feedback(inputs, out, max_rows_per_device=max_rows_per_device,
                               shard_rows=shard_rows, overwrite=overwrite)
    for line in summary_lines(summary):
        print(line, file=sys.stderr)
    emit(as_json, summary, lambda: print(
        f"feedback collect -> {summary['out']}: {summary['rows']['pairs']} pairs, "
        f"{summary['rows']['unpaired']} rated answers from {summary['devices']} device(s), "
        f"{summary['rows']['tasks']} task rows ({summary['rows']['demonstrations']} rated up: "
        f"demonstrations), "
        f"{len(summary['per_model'])} model(s); {summary['scrubbed_replacements']} details scrubbed"))
