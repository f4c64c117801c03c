"""Judge exported models on tool-use tasks in the agent runtime, with real tool execution.

Each task row holds a chat ``prompt`` (or a string), an ``answer`` and optionally the ``tool`` it
needs (as ``slm-align tasks make`` writes them). Every artifact answers every task in :class:`Agent`
with its own tools (:func:`task_tools`), in episodes of up to ``max_tool_rounds`` tool rounds and a
final answer: once greedily (``samples`` 1), or ``samples`` times sampled at ``temperature`` with a
seed per task and sample (:func:`sample_seed`). A finished episode is classified as ``success`` or
one failure (``no_call``, ``malformed_call``, ``wrong_tool``, ``wrong_answer``).

Per artifact (:func:`summarize`): the success rate with its Wilson interval, the call rate, the
valid-call rate, rounds and generated tokens per episode, each failure's count and share; with
samples, pass@k (Chen et al. 2021, :func:`slm_align.stats.pass_at_k`) and pass@1 with bootstrap
intervals over tasks. Artifacts after the first are compared with it on the same tasks (paired
bootstrap interval of the per-task success difference).

No torch, no transformers: like the rest of the runtime.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from slm_align.errors import UserError
from slm_align.ondevice.agent import function_eval, task_batch
from slm_align.ondevice.agent.artifact_forms import FORMS
from slm_align.ondevice.agent.bfcl import load_bfcl, parse_categories
from slm_align.ondevice.agent.loading import Model, load_model
from slm_align.ondevice.agent.prompt import tools_shown
from slm_align.ondevice.agent.runtime import Agent, fold_seed
from slm_align.ondevice.agent.settings import SamplingParams, refuse_unknown, take_options
from slm_align.ondevice.agent.task_settings import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SAMPLES,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOOL_ROUNDS,
    EpisodeSettings,
)
from slm_align.ondevice.rewards.episodes import CATEGORIES, classify
from slm_align.ondevice.rows import iter_rows
from slm_align.ondevice.templates.artifact import check_chat_template
from slm_align.ondevice.tools.builtin import default_tools
from slm_align.ondevice.tools.registry import ToolRegistry
from slm_align.ondevice.tools.specs import registry_for_row
from slm_align.progress import counted, stage_lines
from slm_align.stats import bootstrap_ci, bootstrap_mean_ci, mean_delta, pass_at_k, wilson_interval

FAILURES = CATEGORIES[1:]
SEED_TASK_X, SEED_SAMPLE_X = 1_000_003, 7919
"""Multipliers of :func:`sample_seed` (primes, so that the seeds of tasks and samples rarely
collide)."""
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
    task: int = 0
    """The task's index in the task file (after ``limit``)."""
    sample: int = 0
    """The sample's index for the task (0 when greedy)."""
    seed: Optional[int] = None
    """The sampler's seed (None when greedy)."""
    group: str = ""
    """A function row's category (BFCL's, or the generated rows'); "" for other tasks."""
    reason: str = ""
    """Why a function row's calls failed BFCL's rules ("" otherwise)."""
    truncated: bool = False
    """The final reply stopped at the token budget (``max_tokens``), not at its own end."""

    @property
    def success(self) -> bool:
        """The final answer was right."""
        return self.category == "success"


class _CountingBackend:
    """A backend that counts its completions and the tokens it generates (EOS excluded), over
    every round of a turn: a turn generates once per tool round, then its final answer."""

    def __init__(self, inner):
        self.inner = inner
        self.generated = 0
        self.generations = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompt, params, grammar=None):
        """The inner backend's tokens, counted."""
        self.generations += 1
        for token in self.inner.generate(prompt, params, grammar):
            if token not in self.inner.eos_ids:
                self.generated += 1
            yield token


def check_row(where: str, row) -> None:
    """Refuse a task row without a ``prompt`` or a non-empty ``answer`` (one-line UserError)."""
    if not isinstance(row, dict) or "answer" not in row or "prompt" not in row:
        found = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
        raise UserError(f"{where}: a task row needs 'prompt' and 'answer' columns (found: "
                        f"{found or 'none'}); `slm-align tasks make` writes such rows")
    if row["answer"] is None or str(row["answer"]).strip() == "":
        raise UserError(f"{where}: the task's 'answer' is empty; give every task row the answer "
                        f"its final reply must hold")


def load_tasks(path: Union[str, Path], limit: Optional[int] = None) -> list[dict]:
    """Task rows with a prompt and an answer, or function rows (with ``ground_truth``: see
    :mod:`slm_align.ondevice.agent.function_eval`); a missing file or column, an empty answer, or a
    ground truth naming no offered function is a one-line UserError."""
    rows = []
    for where, row in iter_rows(Path(path)):
        if function_eval.is_function_row(row):
            function_eval.check_function_row(where, row)
        else:
            check_row(where, row)
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


def task_tools(row: dict) -> ToolRegistry:
    """The tools a task offers, as RL's episodes offer them: its ``tools`` schemas, each running the
    built-in of that name (:func:`~slm_align.ondevice.tools.specs.registry_for_row`); the built-ins
    without."""
    if row.get("tools"):
        return registry_for_row(row["tools"], default_tools())
    return default_tools()


def check_artifact_exists(artifact: Union[str, Path]) -> None:
    """Refuse (one line) an artifact path that does not exist (a ``BASE+ADAPTER`` chain is checked
    part by part when it is resolved)."""
    if "+" not in str(artifact) and not Path(artifact).exists():
        raise UserError(f"artifact {artifact} not found; pass {FORMS}")


def load_checked(artifact: Union[str, Path], threads: Optional[int] = None,
                 chat_template: Optional[str] = None) -> Model:
    """The opened ``artifact`` (any form of
    :func:`~slm_align.ondevice.agent.artifact_forms.resolve_artifact`) with a chat template that
    renders (``chat_template``, "chatml" or a Jinja file, in place of its own); a missing, damaged or
    unknown artifact is a one-line UserError."""
    check_artifact_exists(artifact)
    try:  # an unknown form is refused by load_model's resolve_artifact
        model = load_model(artifact, threads=threads, chat_template=chat_template)
    except UserError:
        raise
    except Exception as exc:  # llama.cpp and onnxruntime raise their own types for a damaged file
        raise UserError(f"artifact {artifact} does not load ({type(exc).__name__}: "
                        f"{exc}); export it again") from None
    check_chat_template(model.backend)
    return model


def open_agent(artifact: Union[str, Path], max_tokens: int = DEFAULT_MAX_TOKENS,
               max_tool_rounds: int = DEFAULT_TOOL_ROUNDS, threads: Optional[int] = None,
               call_threshold: Optional[float] = None, chat_template: Optional[str] = None) -> Agent:
    """A greedy agent with the built-in tools on ``artifact`` (any form of
    :func:`~slm_align.ondevice.agent.artifact_forms.resolve_artifact`: a model, base + adapters, an
    adapter export's manifest, a bundle; ``threads``: its backend's, default
    :func:`~slm_align.ondevice.devices.host.default_threads`; ``call_threshold``: the call rule, see
    :mod:`~slm_align.ondevice.agent.call_rule`; ``chat_template``: in place of the artifact's own, as
    ``chat --chat-template``); one that does not load is a UserError."""
    model = load_checked(artifact, threads, chat_template)
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, call_threshold=call_threshold)
    return Agent(_CountingBackend(model.backend), model.sha256, tools=default_tools(), sampling=sampling,
                 max_tool_rounds=max_tool_rounds, describe_tools=True)  # every artifact is shown the tools


def sample_seed(seed: int, task: int, sample: int) -> int:
    """The sampler's seed of one sampled episode: ``seed`` + 1_000_003 * ``task`` + 7919 *
    ``sample``, folded into the 32 bits both backends take, so a run with the same seed, tasks
    and samples draws the same episodes."""
    return fold_seed(seed + SEED_TASK_X * task + SEED_SAMPLE_X * sample)


def _counter(agent: Agent) -> _CountingBackend:
    """The agent's backend, wrapped to count its completions and tokens if it is not yet."""
    if not isinstance(agent.backend, _CountingBackend):
        agent.backend = _CountingBackend(agent.backend)
    return agent.backend


def run_function_task(agent: Agent, row: dict, task: int = 0, sample: int = 0,
                      sampling: Optional[dict] = None) -> TaskResult:
    """One function row in ``agent``: one reply to the row's messages with its tools offered (the
    agent's own tools and rounds are put back after), its calls judged by BFCL's rules."""
    messages = function_eval.function_messages(row)
    counter = _counter(agent)
    generated = counter.generated
    tools, rounds = agent.tools, agent.max_tool_rounds
    agent.tools, agent.max_tool_rounds = function_eval.function_registry(row), 0
    try:
        for _ in agent.respond(messages, **(sampling or {})):
            pass
    finally:
        agent.tools, agent.max_tool_rounds = tools, rounds
    text = agent.last.text
    verdict, calls = function_eval.judge_reply(row, text)
    return TaskResult(question=messages[-1].get("content", ""), answer=function_eval.answer_text(row),
                      reply=text, category="success" if verdict.ok else verdict.failure, calls=len(calls),
                      valid_calls=function_eval.valid_calls(row, calls), rounds=0,
                      tokens=counter.generated - generated, task=task, sample=sample,
                      seed=(sampling or {}).get("seed"), group=str(row.get("category") or ""),
                      reason=verdict.reason, truncated=agent.last.truncated)


def run_task(agent: Agent, row: dict, task: int = 0, sample: int = 0,
             sampling: Optional[dict] = None) -> TaskResult:
    """One episode of a task in ``agent``: the turn runs to its final answer, then is classified.

    ``sampling`` overrides the agent's sampling settings (``temperature``, ``seed``); without it
    the agent's own (greedy, from :func:`open_agent`). Rounds are the turn's completions before
    its final answer, tokens those generated over all of them, counted around the backend. A
    function row: :func:`run_function_task`.
    """
    if function_eval.is_function_row(row):
        return run_function_task(agent, row, task, sample, sampling)
    messages = task_messages(row)
    agent.tools = task_tools(row)
    counter = _counter(agent)
    generated, generations = counter.generated, counter.generations
    for _ in agent.respond(messages, **(sampling or {})):
        pass
    reply = agent.last
    answer = str(row["answer"])
    category = classify(reply.tool_calls, reply.text, answer, _expected_tool(row))
    return TaskResult(question=messages[-1].get("content", ""), answer=answer, reply=reply.text,
                      category=category, calls=len(reply.tool_calls),
                      valid_calls=sum(1 for call in reply.tool_calls if call["ok"]),
                      rounds=max(0, counter.generations - generations - 1),
                      tokens=counter.generated - generated, task=task, sample=sample,
                      seed=(sampling or {}).get("seed"), truncated=reply.truncated)


def run_episodes(agent: Agent, rows: Sequence[dict], samples: int = DEFAULT_SAMPLES,
                 temperature: float = DEFAULT_TEMPERATURE, seed: int = 0, label: str = "episodes",
                 batch: int = 1) -> list[TaskResult]:
    """Every task once greedily (``samples`` 1), or ``samples`` times at ``temperature`` with the
    seeds of :func:`sample_seed`; the results task by task, samples in order. Counted as ``label``
    in the running stage's progress. ``batch``: episodes decoded together on a GGUF model
    (:mod:`~slm_align.ondevice.agent.task_batch`; the same results as one at a time)."""
    plan = [(task, row, sample) for task, row in enumerate(rows) for sample in range(samples)]
    done: list[TaskResult] = []

    def episode(runner: Agent, step: tuple) -> TaskResult:
        task, row, sample = step
        sampling = None if samples == 1 else {"temperature": temperature, "seed": sample_seed(seed, task, sample)}
        return run_task(runner, row, task, sample, sampling)

    with counted(label, len(plan), "episodes") as count:
        def tally(result: TaskResult) -> None:
            done.append(result)
            count.advance(status=f"success {sum(r.success for r in done)}/{len(done)}")

        if task_batch.batches(agent, batch):
            return task_batch.run_batched(agent, plan, batch, _CountingBackend, episode, tally)
        for step in plan:
            tally(episode(agent, step))
    return done


def successes_by_task(results: Sequence[TaskResult]) -> list[list[bool]]:
    """Each task's successes, one per sample, tasks in their first appearance's order."""
    groups: dict[int, list[bool]] = {}
    for r in results:
        groups.setdefault(r.task, []).append(r.success)
    return list(groups.values())


def task_success_rates(results: Sequence[TaskResult], samples: int = DEFAULT_SAMPLES
                       ) -> list[float]:
    """Each task's success rate c/n: one value per result when greedy (``samples`` 1), else the
    share of each task's samples that succeeded."""
    if samples == 1:
        return [float(r.success) for r in results]
    return [statistics.fmean(group) for group in successes_by_task(results)]


def pass_figures(results: Sequence[TaskResult], samples: int, seed: int = 0) -> dict:
    """pass@k and pass@1 of sampled episodes, with intervals; None when greedy (``samples`` 1).

    With n samples and c successes on a task, pass@k = mean over tasks of 1 - C(n-c, k)/C(n, k),
    the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
    Code", eq. 1) with k = ``samples`` (k = n: the share of tasks with at least one success);
    pass@1 = mean over tasks of c/n. Each interval is a 95% percentile bootstrap over tasks
    (2000 resamples), which keeps the samples of a task together: they are not independent.
    """
    if samples == 1:
        return {key: None for key in ("pass_at_k", "pass_at_k_ci95", "pass_at_1", "pass_at_1_ci95")}
    groups = successes_by_task(results)
    per_task = {"pass_at_k": [pass_at_k(len(group), sum(group), samples) for group in groups],
                "pass_at_1": [sum(group) / len(group) for group in groups]}
    figures = {}
    for name, values in per_task.items():
        figures[name] = statistics.fmean(values)
        figures[f"{name}_ci95"] = list(bootstrap_mean_ci(values, seed=seed))
    return figures


def failure_figures(results: Sequence[TaskResult]) -> dict:
    """The count and the share of the episodes of each failure category."""
    counts = {name: sum(1 for r in results if r.category == name) for name in FAILURES}
    shares = {name: count / len(results) for name, count in counts.items()}
    return {"failures": counts, "failure_shares": shares}


def summarize(results: Sequence[TaskResult], samples: int = DEFAULT_SAMPLES, seed: int = 0) -> dict:
    """One artifact's figures over its episodes (one per task when greedy, ``samples`` per task
    otherwise).

    ``success_rate`` = successes / episodes with its 95% Wilson score interval (Wilson 1927,
    :func:`slm_align.stats.wilson_interval`; over n·k sampled episodes it treats them as
    independent, see ``pass_at_1_ci95`` for the interval over tasks); ``call_rate`` = share of
    episodes with at least one call; ``valid_call_rate`` = calls that parsed, validated and ran ok
    / calls (None without calls); rounds and generated tokens per episode; ``truncated``: episodes
    whose final reply stopped at the token budget (a call cut there fails as malformed); each
    failure's count and share; and :func:`pass_figures`.
    """
    episodes = len(results)
    successes = sum(1 for r in results if r.success)
    calls = sum(r.calls for r in results)
    valid = sum(r.valid_calls for r in results)
    return {
        "tasks": episodes if samples == 1 else len(successes_by_task(results)),
        "episodes": episodes,
        "successes": successes,
        "success_rate": successes / episodes,
        "success_ci95": list(wilson_interval(successes, episodes)),
        "calls": calls,
        "valid_calls": valid,
        "valid_call_rate": valid / calls if calls else None,
        "call_rate": statistics.fmean(float(r.calls > 0) for r in results),
        "rounds_per_task": statistics.fmean(r.rounds for r in results),
        "tokens_per_task": statistics.fmean(r.tokens for r in results),
        "truncated": sum(1 for r in results if r.truncated),
        **failure_figures(results),
        **pass_figures(results, samples, seed),
        "by_category": function_eval.category_figures(results),
    }


def compare(baseline: Sequence[TaskResult], candidate: Sequence[TaskResult], seed: int = 0,
            samples: int = DEFAULT_SAMPLES) -> dict:
    """The success difference candidate - baseline on the same tasks (each task's success rate
    c/n when sampled), its paired bootstrap 95% interval over tasks, a verdict."""
    a = task_success_rates(baseline, samples)
    b = task_success_rates(candidate, samples)
    delta = mean_delta(a, b)
    low, high = bootstrap_ci(a, b, mean_delta, seed=seed)
    if low > 0:
        verdict = "better"
    elif high < 0:
        verdict = "worse"
    else:
        verdict = "no clear difference (the interval includes zero)"
    return {"success_delta": delta, "ci95": [low, high], "verdict": verdict}


def compare_by_category(baseline: Sequence[TaskResult], candidate: Sequence[TaskResult], seed: int = 0,
                        samples: int = DEFAULT_SAMPLES) -> Optional[dict]:
    """:func:`compare` within each row category of function rows (None without categories)."""
    groups = list(dict.fromkeys(r.group for r in baseline if r.group))
    if not groups:
        return None
    return {group: compare([r for r in baseline if r.group == group], [r for r in candidate if r.group == group],
                           seed, samples) for group in groups}


def task_rows(tasks: Union[str, Path, None], bfcl: Optional[str], limit: Optional[int]) -> tuple[list[dict], str]:
    """The task rows and what they are called in the report: a task file's rows, or with ``bfcl``
    (``simple_python,multiple,...``) BFCL v4's entries of those categories, ``limit`` of each."""
    if (tasks is None) == (bfcl is None):
        raise UserError("pass a task file or --bfcl CATEGORIES (e.g. --bfcl simple_python,irrelevance), "
                        "one of the two")
    if bfcl is not None:
        categories = parse_categories(bfcl)
        return load_bfcl(categories, limit), f"BFCL v4: {','.join(categories)}"
    return load_tasks(tasks, limit), str(tasks)


def evaluate_artifacts(tasks: Union[str, Path, None], artifacts: Sequence[Union[str, Path]],
                       settings: EpisodeSettings = EpisodeSettings(), bfcl: Optional[str] = None,
                       limit: Optional[int] = None, **options: Any) -> dict:
    """Every artifact on the same task rows (a task file, or BFCL's categories ``bfcl`` with
    ``limit`` entries of each), its episodes run as ``settings`` say; ``options``: any field of
    :class:`~slm_align.ondevice.agent.task_settings.EpisodeSettings` by name (``max_tokens=...``,
    ``batch=...``), replacing ``settings``'. The report: how the episodes ran, per artifact its
    :func:`summarize` figures and per-episode ``results``, and each artifact after the first
    compared with the first (:func:`compare`, and per category for function rows). Settings, rows
    and artifacts are checked before any episode runs."""
    settings = take_options(settings, options)
    refuse_unknown("evaluate_artifacts", options)
    settings.check()
    if not artifacts:
        raise UserError("pass at least one --artifact (a .gguf file or an ONNX export directory)")
    rows, name = task_rows(tasks, bfcl, limit)
    agents = [open_agent(artifact, settings.max_tokens, settings.max_tool_rounds, settings.threads,
                         settings.call_threshold, settings.chat_template)
              for artifact in artifacts]  # all load, or none runs
    runs, summaries = _run_artifacts(agents, artifacts, rows, settings)
    report = {"tasks": name, "n_tasks": len(rows), "max_tokens": settings.max_tokens,
              "max_tool_rounds": settings.max_tool_rounds, **settings.report(),
              "artifacts": [], "comparisons": []}
    for agent, artifact, results, summary in zip(agents, artifacts, runs, summaries):
        shown = tools_shown(agent.backend, agent.describe_tools)
        report["artifacts"].append({"artifact": str(artifact), "tools_shown": shown, **summary,
                                    "results": [asdict(r) for r in results]})
    for artifact, results in zip(artifacts[1:], runs[1:]):
        comparison = _comparison(artifacts[0], runs[0], artifact, results, settings)
        report["comparisons"].append(comparison)
    return report


def _run_artifacts(agents: Sequence[Agent], artifacts: Sequence[Union[str, Path]], rows: list[dict],
                   settings: EpisodeSettings) -> tuple[list[list[TaskResult]], list[dict]]:
    """Each agent's episodes on ``rows`` and their :func:`summarize` figures, as one stage."""
    samples, seed = settings.samples, settings.seed
    with stage_lines("evaluate-agent", f"{len(agents)} model(s) on {len(rows)} tasks x {samples} "
                                       f"episode(s)") as stage:
        runs = [run_episodes(agent, rows, samples, settings.temperature, seed,
                             "/".join(Path(artifact).parts[-2:]), settings.batch)
                for agent, artifact in zip(agents, artifacts)]
        summaries = [summarize(results, samples, seed) for results in runs]
        rates = ", ".join(f"{summary['success_rate']:.3f}" for summary in summaries)
        stage.figures = f"task success {rates}"
    return runs, summaries


def _comparison(baseline: Union[str, Path], before: Sequence[TaskResult],
                candidate: Union[str, Path], after: Sequence[TaskResult],
                settings: EpisodeSettings) -> dict:
    """The report's comparison of ``candidate``'s episodes with ``baseline``'s."""
    seed, samples = settings.seed, settings.samples
    return {"baseline": str(baseline), "candidate": str(candidate),
            **compare(before, after, seed, samples),
            "by_category": compare_by_category(before, after, seed, samples)}
