"""``slm-align chat``: a terminal conversation with feedback commands, over the
same Agent an app embeds."""

from __future__ import annotations

import re
from typing import Callable, Iterable

from slm_align.errors import UserError

SEQUENCE = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves, a cleared screen
                      r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"  # OSC, DCS
                      r"|\x1b(?![\[\]PX^_])[ -/]*[0-~]")  # two-character escapes
"""Terminal control sequences a model's text could carry (a title change, the
clipboard, a cleared screen)."""
CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""Control characters but newline and tab, C1 included."""
INTRODUCERS = "\x1b\x90\x98\x9b\x9d\x9e\x9f"
MAX_PENDING = 256
"""An unfinished sequence longer than this is not held back for the next piece."""


def printable(text: str) -> str:
    """``text`` without terminal control sequences and control characters, newline and tab kept."""
    return CONTROLS.sub("", SEQUENCE.sub("", text))


class PrintableStream:
    """:func:`printable` over streamed pieces: a sequence cut between two pieces is
    held until it is whole."""

    def __init__(self):
        self.pending = ""

    def feed(self, piece: str) -> str:
        """The printable part of ``piece`` (and of what was held), holding back
        an unfinished sequence."""
        text = self.pending + piece
        start = max(text.rfind(ch) for ch in INTRODUCERS)
        unfinished = start >= 0 and SEQUENCE.match(text, start) is None and len(text) - start <= MAX_PENDING
        cut = start if unfinished else len(text)
        self.pending = text[cut:]
        return printable(text[:cut])

    def flush(self) -> str:
        """Whatever was held, printable."""
        text = self.pending
        self.pending = ""
        return printable(text)

HELP = ("commands: /good  /bad  /compare (second answer, then /pick 1|2)  /edit TEXT  /tools (show "
        "calls)  /reset  /save FILE  /quit")


def _command(agent, line: str, state: dict, say: Callable[[str], None]) -> bool:
    """Handle one /command; False means quit."""
    name, _, arg = line[1:].partition(" ")
    if name in ("quit", "exit"):
        return False
    if name in ("good", "bad"):
        agent.feedback("up" if name == "good" else "down")
        say(f"[recorded: thumbs {'up' if name == 'good' else 'down'}]")
    elif name == "compare":
        state["other"] = agent.alternative()
        say(f"[1] {agent.last.text}\n[2] {state['other']}\n[pick the better one "
            "with /pick 1 or /pick 2]")
    elif name == "pick" and arg.strip() in ("1", "2") and state.get("other") is not None:
        agent.feedback("choice", other=state.pop("other"), preferred="this" if arg.strip() == "1" else "other")
        say(f"[recorded: answer {arg.strip()} preferred]")
    elif name == "edit" and arg.strip():
        agent.feedback("edit", text=arg.strip())
        say("[recorded: your edit is preferred over the answer]")
    elif name == "tools":
        state["show_tools"] = not state.get("show_tools", False)
        say(f"[tool calls {'shown' if state['show_tools'] else 'hidden'}]")
    elif name == "reset":
        agent.reset()
        say("[new conversation]")
    elif name == "save" and arg.strip():
        say(f"[saved to {agent.save(arg.strip())}]")
    else:
        say(HELP)
    return True


def chat_loop(agent, lines: Iterable[str], say: Callable[[str], None], write: Callable[[str], None]) -> None:
    """Read messages and /commands from ``lines``; stream answers with ``write``;
    notes with ``say``. What the model wrote reaches the terminal without control
    sequences (:func:`printable`)."""
    say = _printably(say)
    state: dict = {}
    say(HELP)
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            try:
                if not _command(agent, line, state, say):
                    return
            except UserError as exc:  # feedback without a store, nothing to compare yet...: say so, keep chatting
                say(f"[{exc}]")
            continue
        write_printably(agent.stream(line), write)
        if state.get("show_tools"):
            for call in agent.last.tool_calls:
                say(f"[tool {call['name']}({call['arguments']}) -> "
                    f"{'ok' if call['ok'] else 'error'}: {call['content']}]")


RAW_HELP = "raw mode: each line you type is continued as plain text (no template, no tools, nothing recorded); /quit"


def raw_loop(agent, lines: Iterable[str], say: Callable[[str], None], write: Callable[[str], None]) -> None:
    """``chat --raw``: each line from ``lines`` is continued as plain text (:meth:`Agent.complete`)
    and the continuation streamed with ``write``; /quit ends."""
    say(RAW_HELP)
    for line in lines:
        text = line.rstrip("\r\n")
        if text.strip() in ("/quit", "/exit"):
            return
        if text.strip():
            write_printably(agent.complete(text), write)


def write_printably(pieces: Iterable[str], write: Callable[[str], None]) -> None:
    """Stream ``pieces`` with ``write`` without terminal control sequences
    (:class:`PrintableStream`), then a newline."""
    stream = PrintableStream()
    for piece in pieces:
        write(stream.feed(piece))
    write(stream.flush() + "\n")


def _printably(say: Callable[[str], None]) -> Callable[[str], None]:
    """``say``, with control sequences removed from what it is given."""
    def printable_say(text: str) -> None:
        say(printable(text))
    return printable_say
