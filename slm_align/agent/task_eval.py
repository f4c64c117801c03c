"""Judge exported models on tool-use tasks in the agent runtime, with real tool execution.

Each task row holds a chat ``prompt`` (or a string), an ``answer`` and optionally the
``tool`` it needs (as ``slm-align tasks make`` writes them). Every artifact answers every
task greedily in :class:`Agent` with
:func:`default_tools`; a finished turn is classified as ``success`` or one failure (``no_call``,
``malformed_call``, ``wrong_tool``, ``wrong_answer``), and artifacts after the first are compared
with it on the same tasks (paired bootstrap interval of the success difference).

No torch, no transformers: like the rest of the runtime.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from slm_align.agent.runtime import Agent, load_model
from slm_align.agent.sampling import SamplingParams
from slm_align.errors import UserError
from slm_align.rewards.answers import exact_answer
from slm_align.stats import bootstrap_ci, mean_delta
from slm_align.tools.builtin import default_tools

CATEGORIES = ("success", "no_call", "malformed_call", "wrong_tool", "wrong_answer")
FAILURES = CATEGORIES[1:]
DEFAULT_MAX_TOKENS = 96
DEFAULT_TOOL_ROUNDS = 3


def answers_match(text: str, answer: str) -> bool:
    """The final answer in ``text`` equals ``answer`` (numbers by value): the rule of the
    ``exact_answer`` reward, so that evaluation judges success as RL rewarded it."""
    return exact_answer([""], [text], answer=[answer])[0] == 1.0


def classify(calls: Sequence[dict], final_text: str, answer: str, tool: Optional[str] = None) -> str:
    """The category of one finished turn.

    Args:
        calls: The runtime's record of the calls made (``Reply.tool_calls``:
        ``name``, ``arguments``, ``ok``);
            a call that could not be parsed has ``arguments`` None and ``ok`` False.
        final_text: The final reply.
        answer: The task's answer.
        tool: The tool the task needs (None: any tool will do).

    Returns ``success`` when the final answer is right (with or without a call); else ``no_call``;
    else ``wrong_answer`` when the right tool ran; else ``wrong_tool`` when another tool was named;
    else ``malformed_call`` (unparseable, or the tool refused its arguments).
    """
    if answers_match(final_text, answer):
        return "success"
    if not calls:
        return "no_call"
    if any(call["ok"] and (tool is None or call["name"] == tool) for call in calls):
        return "wrong_answer"
    if tool is not None and any(call["name"] and call["name"] != tool for call in calls):
        return "wrong_tool"
    return "malformed_call"


@dataclass
class TaskResult:
    """One artifact's turn on one task."""

    question: str
    answer: str
    reply: str
    category: str
    calls: int
    valid_calls: int
    rounds: int
    tokens: int

    @property
    def success(self) -> bool:
        """The final answer was right."""
        return self.category == "success"


class _CountingBackend:
    """A backend that counts the tokens it generates (EOS excluded), over every round of a turn."""

    def __init__(self, inner):
        self.inner = inner
        self.generated = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompt, params, grammar=None):
        """The inner backend's tokens, counted."""
        for token in self.inner.generate(prompt, params, grammar):
            if token not in self.inner.eos_ids:
                self.generated += 1
            yield token


def load_tasks(path: Union[str, Path], limit: Optional[int] = None) -> list[dict]:
    """Task rows with a prompt and an answer; a missing file or column is a one-line UserError."""
    from slm_align.data.readers import iter_rows

    rows = []
    for where, row in iter_rows(Path(path)):
        if not isinstance(row, dict) or "answer" not in row or "prompt" not in row:
            found = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
            raise UserError(f"{where}: a task row needs 'prompt' and 'answer' columns (found: {found or 'none'}); "
                            "`slm-align tasks make` writes such rows")
        rows.append(row)
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise UserError(f"{path} holds no tasks")
    return rows


def task_messages(row: dict) -> list[dict]:
    """The chat a task starts from: its prompt messages, or a string prompt as one user message."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise UserError("a task's 'prompt' must be text or a list of {role, content} messages")


def _expected_tool(row: dict) -> Optional[str]:
    """The tool a task needs: its ``tool`` column, else the only tool of its ``tools`` schemas."""
    if isinstance(row.get("tool"), str):
        return row["tool"]
    tools = row.get("tools")
    if isinstance(tools, list) and len(tools) == 1 and isinstance(tools[0], dict):
        return tools[0].get("function", {}).get("name")
    return None


def open_agent(artifact: Union[str, Path], max_tokens: int = DEFAULT_MAX_TOKENS,
               max_tool_rounds: int = DEFAULT_TOOL_ROUNDS) -> Agent:
    """A greedy agent with the built-in tools on ``artifact``; one that does
    not load is a UserError."""
    artifact = Path(artifact)
    if not artifact.exists():
        raise UserError(f"artifact {artifact} not found; pass a .gguf file or an ONNX export "
                        f"directory")
    try:
        model = load_model(artifact)
    except UserError:
        raise
    except Exception as exc:  # llama.cpp and onnxruntime raise their own types for a damaged file
        raise UserError(f"artifact {artifact} does not load ({type(exc).__name__}: {exc}); export "
                        f"it again") from None
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Agent(_CountingBackend(model.backend), model.sha256, tools=default_tools(), sampling=sampling,
                 max_tool_rounds=max_tool_rounds)


def run_task(agent: Agent, row: dict) -> TaskResult:
    """One task in ``agent``: the turn runs to its final answer, then is classified."""
    messages = task_messages(row)
    counter = agent.backend
    before = counter.generated if isinstance(counter, _CountingBackend) else 0
    for _ in agent.respond(messages):
        pass
    reply = agent.last
    added = agent.messages[len(messages):]
    rounds = tool_rounds(added)
    tokens = counter.generated - before if isinstance(counter, _CountingBackend) else reply.tokens
    answer = str(row["answer"])
    category = classify(reply.tool_calls, reply.text, answer, _expected_tool(row))
    return TaskResult(question=messages[-1].get("content", ""), answer=answer, reply=reply.text,
                      category=category, calls=len(reply.tool_calls),
                      valid_calls=sum(1 for call in reply.tool_calls if call["ok"]), rounds=rounds, tokens=tokens)


def tool_rounds(added: list[dict]) -> int:
    """The rounds of a turn that asked for tools: its assistant messages answered by a tool
    message (a well-formed call or not)."""
    return sum(1 for message, after in zip(added, added[1:])
               if message["role"] == "assistant" and after["role"] == "tool")


def summarize(results: Sequence[TaskResult]) -> dict:
    """Success rate, valid-call rate (ok calls / calls), share of tasks with a call, rounds and
    tokens per task, and the count of each failure."""
    calls = sum(r.calls for r in results)
    return {
        "tasks": len(results),
        "success_rate": statistics.fmean(float(r.success) for r in results),
        "valid_call_rate": sum(r.valid_calls for r in results) / calls if calls else None,
        "call_rate": statistics.fmean(float(r.calls > 0) for r in results),
        "rounds_per_task": statistics.fmean(r.rounds for r in results),
        "tokens_per_task": statistics.fmean(r.tokens for r in results),
        "failures": {name: sum(1 for r in results if r.category == name) for name in FAILURES},
    }


def compare(baseline: Sequence[TaskResult], candidate: Sequence[TaskResult], seed: int = 0) -> dict:
    """The success difference candidate - baseline on the same tasks, its paired bootstrap
    95% interval, a verdict."""
    a = [float(r.success) for r in baseline]
    b = [float(r.success) for r in candidate]
    delta = mean_delta(a, b)
    low, high = bootstrap_ci(a, b, mean_delta, seed=seed)
    if low > 0:
        verdict = "better"
    elif high < 0:
        verdict = "worse"
    else:
        verdict = "no clear difference (the interval includes zero)"
    return {"success_delta": delta, "ci95": [low, high], "verdict": verdict}


def evaluate_artifacts(tasks: Union[str, Path], artifacts: Sequence[Union[str, Path]], limit: Optional[int] = None,
                       max_tokens: int = DEFAULT_MAX_TOKENS, max_tool_rounds: int = DEFAULT_TOOL_ROUNDS,
                       seed: int = 0) -> dict:
    """Every artifact on the same task rows; the report: per artifact its summary and per-task
    results, and each artifact after the first compared with the first."""
    if not artifacts:
        raise UserError("pass at least one --artifact (a .gguf file or an ONNX export directory)")
    rows = load_tasks(tasks, limit)
    agents = [open_agent(artifact, max_tokens, max_tool_rounds) for artifact in artifacts]  # all load, or none runs
    runs = [[run_task(agent, row) for row in rows] for agent in agents]
    report = {"tasks": str(tasks), "n_tasks": len(rows), "max_tokens": max_tokens, "max_tool_rounds": max_tool_rounds,
              "artifacts": [], "comparisons": []}
    for artifact, results in zip(artifacts, runs):
        report["artifacts"].append({"artifact": str(artifact), **summarize(results),
                                    "results": [asdict(r) for r in results]})
    for artifact, results in zip(artifacts[1:], runs[1:]):
        report["comparisons"].append({"baseline": str(artifacts[0]), "candidate": str(artifact),
                                      **compare(runs[0], results, seed)})
    return report
