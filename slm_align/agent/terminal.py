"""``slm-align chat``: a terminal conversation with feedback commands, over the same Agent an app embeds."""

from __future__ import annotations

from typing import Callable, Iterable

from slm_align.errors import UserError

HELP = ("commands: /good  /bad  /compare (second answer, then /pick 1|2)  /edit TEXT  /tools (show calls)  "
        "/reset  /save FILE  /quit")


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
        say(f"[1] {agent.last.text}\n[2] {state['other']}\n[pick the better one with /pick 1 or /pick 2]")
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
    """Read messages and /commands from ``lines``; stream answers with ``write``; notes with ``say``."""
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
        for piece in agent.stream(line):
            write(piece)
        write("\n")
        if state.get("show_tools"):
            for call in agent.last.tool_calls:
                say(f"[tool {call['name']}({call['arguments']}) -> {'ok' if call['ok'] else 'error'}: "
                    f"{call['content']}]")
