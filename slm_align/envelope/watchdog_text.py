"""What the watchdog's events and record say to people: console lines and
``eval/report.md``'s watchdog section."""

from __future__ import annotations

from typing import Optional


def shaping_note(event: dict) -> str:
    """", call-format shaping xS" for a tool-use-collapse rollback (S: the term's weight over its
    base weight), else ""."""
    if event["action"] != "rollback" or event["detector"] != "tool_use_collapse":
        return ""
    return f", call-format shaping x{event.get('shaping_scale', 1.0):g}"


def event_line(event: dict) -> str:
    """The console line of an event."""
    if event["action"] == "stop":
        tail = f"recoveries spent: stopping early; publishing iteration {event['best_step']}'s adapter"
    else:
        tail = (f"rolled back to iteration {event['best_step']}, learning rate "
                f"x{event['lr_scale']:g}{shaping_note(event)} (recovery {event['recoveries']})")
    return f"watchdog: {event['detector']} at iteration {event['step']} ({event['why']}); {tail}"


def published_line(record: Optional[dict]) -> Optional[str]:
    """The console line at the end of RL: which iteration's adapter was published
    (None without a record)."""
    if record is None:
        return None
    if not record["enabled"]:
        return f"published: the last adapter, iteration {record['published_step']} (watchdog off)"
    line = f"published: the adapter of iteration {record['published_step']} (the watchdog's best held-out probe)"
    last = record.get("last")
    if last is not None and not last["is_published"]:
        line += f"; the last, iteration {last['step']}, kept as rl/adapter-last (export --stage rl-last)"
    if record.get("stopped_early"):
        line += f"; stopped early on {record['stopped_early']}"
    return line


def report_section(record: Optional[dict], events: list[dict]) -> list[str]:
    """The Markdown lines of ``eval/report.md``'s watchdog section: off, or what was
    published and each event."""
    if record is None:
        return []
    lines = ["## Watchdog", ""]
    if not record.get("enabled"):
        return lines + [f"The collapse watchdog was off (`--watchdog off`): the last adapter "
                        f"(iteration {record['published_step']}) is published.", ""]
    lines.append(f"Published: the adapter of iteration {record['published_step']} (the peak of "
                 f"the held-out probe, mean reward {record['best_reward']:.3f}); the last "
                 f"iteration's adapter is kept as `rl/adapter-last` (`export --stage rl-last`).")
    if record.get("stopped_early"):
        lines.append(f"Stopped early: {record['stopped_early']}.")
    lines.append("")
    if not events:
        return lines + ["No detector fired.", ""]
    lines += ["| iteration | detector | value | threshold | action | learning rate |",
              "|---|---|---|---|---|---|"]
    for e in events:
        lines.append(f"| {e['step']} | {e['detector']} | {e['value']:.3g} | {e['threshold']:.3g} | "
                     f"{e['action']}{shaping_note(e)} | {e['learning_rate']:.3g} |")
    return lines + [""]
