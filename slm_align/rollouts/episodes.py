"""Agent episodes as RL rollouts: each is run by the runtime's own chat loop (its template, parser,
stop rules and tools; :class:`~slm_align.ondevice.agent.runtime.Agent`) on the policy being trained
(:class:`~slm_align.rollouts.policy_backend.PolicyBackend`), and trained token for token.

An episode's sequence is the first prompt's ids, then for each round the ids the policy sampled and
the ids the runtime inserted after them (the template's text around the tool results), exactly as
the runtime fed them (``Agent.trace``): nothing is tokenised again. Only sampled ids train: the
rollout's mask is 1 on them and 0 on inserted ids, so log-probabilities, ratios, KL, entropy, values
and GAE count sampled positions only.

Where the runtime renders a round's prompt anew instead of extending the ids (the conversation outgrew the
context; a template that drops earlier calls or reasoning makes the new rendering shorter than the ids
fed), the trained sequence stops there and the final answer's ids are not in it: the answer's reward
would land on the calls' tokens. Such an episode (``rerendered``) trains nothing (its mask row is 0) and
is counted in ``episode/rerendered``.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from slm_align.config import RLSettings
from slm_align.data.readers import iter_rows
from slm_align.data.tasks import TaskSet
from slm_align.envelope.policy import merged_for_sampling
from slm_align.errors import UserError
from slm_align.modeling.accelerator import device_of
from slm_align.ondevice.agent.batching import Engine, run_many
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.rewards.builtin import load_reward_fn
from slm_align.ondevice.rewards.columns import named_terms
from slm_align.ondevice.rewards.episodes import classify
from slm_align.ondevice.rewards.function_calls import reply_calls
from slm_align.ondevice.templates.chat import default_chat_template, require_tool_template
from slm_align.ondevice.tools.builtin import default_tools
from slm_align.ondevice.tools.environment import check_allowed, load_environment, open_environment
from slm_align.ondevice.tools.registry import ToolRegistry
from slm_align.ondevice.tools.specs import registry_for_row
from slm_align.progress import counted
from slm_align.rollouts.completions import (
    Packed,
    Passes,
    Rollout,
    RolloutModels,
    scoring_passes,
    truncation_rules,
)
from slm_align.rollouts.phases import PhaseClock
from slm_align.rollouts.policy_decoder import PolicyDecoder

SEED_SPAN = 2 ** 32
MAX_SLOTS = 64
"""Most episodes one PyTorch forward decodes together (the rest wait for a slot)."""


@dataclass
class EpisodeSetup:
    """What one episode starts from: the task's messages, the tools it may call, the environment
    instance (None without one)."""

    messages: list[dict]
    tools: ToolRegistry
    environment: Any = None


@dataclass
class AgentTasks:
    """The task rows RL runs as episodes, and the tools each row gets: the row's ``environment``
    (``module:Class``, or ``environment`` for every row) when it names one, else the row's ``tools``
    schemas run by the built-in tools of those names, else every built-in tool."""

    tasks: TaskSet
    environment: Optional[str] = None
    """``--environment``: the class every row without its own ``environment`` column runs."""
    chat_template: Optional[str] = None
    """The template episodes render with (None: the tokenizer's own, else ChatML's)."""
    executables: ToolRegistry = field(default_factory=default_tools)
    """The tools that run a row's named tool schemas (the built-ins)."""
    allowed_modules: Sequence[str] = ()
    """``--environment-module``: the modules whose classes a row's own ``environment`` may name."""

    def __post_init__(self):
        check_row_environments(self.tasks.columns, allowed_modules(self.allowed_modules, self.environment))
        for spec in self.environment_specs():
            load_environment(spec)  # refused in one line before any training

    def environment_specs(self) -> set[str]:
        """Every environment the rows name (``--environment`` for all of them included)."""
        specs = {row.get("environment") for row in self.tasks.columns} - {None}
        return specs | ({self.environment} if self.environment else set())

    def check_template(self, tokenizer) -> None:
        """Refuse, in one line, a chat template that cannot show a tool conversation (Gemma 3's)."""
        require_tool_template(self.chat_template or tokenizer.chat_template or default_chat_template(tokenizer))

    def every_row_has_environment(self) -> bool:
        """Every row's episode runs an environment (its own, or ``--environment``)."""
        return bool(self.environment) or all(row.get("environment") for row in self.tasks.columns)

    def open(self, prompt: str) -> EpisodeSetup:
        """A fresh episode of the task whose prompt is ``prompt``."""
        row = self.tasks.row(prompt)
        messages = [dict(m) for m in self.tasks.conversation(prompt)]
        spec = row.get("environment") or self.environment
        if spec is None:
            tools = registry_for_row(row["tools"], self.executables) if row.get("tools") else self.executables
            return EpisodeSetup(messages, tools)
        columns = {key: value for key, value in row.items() if key != "environment"}
        instance, tools, observation = open_environment(_environment_class(spec), columns)
        if observation:
            messages[-1] = dict(messages[-1], content=f"{messages[-1]['content']}\n{observation}")
        return EpisodeSetup(messages, tools, instance)


def agent_tasks(settings: RLSettings, tasks: Optional[TaskSet]) -> Optional[AgentTasks]:
    """The task rows RL runs as episodes, or None for one completion per prompt: ``episodes`` "on",
    or "auto" when some row has ``tools`` or an ``environment`` or ``environment`` is set."""
    check_episode_settings(settings, tasks is not None)
    if settings.episodes == "off" or tasks is None:
        return None
    names = set(tasks.all_column_names())
    wanted = settings.episodes == "on" or bool(settings.environment) or bool(names & {"tools", "environment"})
    if not wanted:
        return None
    return AgentTasks(tasks, settings.environment, allowed_modules=tuple(settings.environment_modules))


def allowed_modules(named: Sequence[str], environment: Optional[str]) -> tuple[str, ...]:
    """The modules task rows may name an environment from: those the user allowed
    (``--environment-module``) and the module of ``--environment``, which the user named."""
    return tuple(named) + ((environment.partition(":")[0],) if environment else ())


def check_row_environments(rows: Sequence[dict], allowed: Sequence[str], where: str = "task row") -> None:
    """Refuse, in one line and before any import, a row whose ``environment`` names a class in a module
    not in ``allowed`` (:func:`~slm_align.ondevice.tools.environment.check_allowed`)."""
    for index, row in enumerate(rows, 1):
        if isinstance(row, dict) and row.get("environment") is not None:
            check_allowed(row["environment"], allowed, f"{where} {index}")


def check_task_file(settings: RLSettings, path) -> None:
    """:func:`check_row_environments` on a local task file's rows, before any stage runs (episodes
    off: no environment is imported; a dataset named by hub id is checked when its rows are read)."""
    if path is None or settings.episodes == "off" or not Path(path).exists():
        return
    allowed = allowed_modules(settings.environment_modules, settings.environment)
    for where, row in iter_rows(Path(path)):
        if isinstance(row, dict) and row.get("environment") is not None:
            check_allowed(row["environment"], allowed, where)


def check_episode_settings(settings: RLSettings, has_tasks: bool, rewards: Sequence[str] = ()) -> None:
    """What can be refused before any stage runs: episodes asked for without task rows, an
    ``--environment`` that does not load, a reward spec that scores episodes when RL samples single
    completions (``--episodes off``, or no task rows; :func:`refuse_episode_terms`)."""
    if not has_tasks and (settings.episodes == "on" or settings.environment):
        raise UserError("agent episodes need task rows: pass --tasks FILE (rows with a prompt, an answer "
                        "and tools or an environment), or drop --episodes on / --environment")
    if settings.environment and settings.episodes != "off":
        load_environment(settings.environment)
    if settings.episodes == "off" or not has_tasks:
        refuse_episode_terms([(spec, load_reward_fn(spec)[1]) for spec in rewards], None)


def check_episode_rewards(reward_fn, tasks: Optional[AgentTasks]) -> None:
    """:func:`refuse_episode_terms` on each term of the combined reward, before training."""
    refuse_episode_terms(named_terms(reward_fn), tasks)


def refuse_episode_terms(terms: Sequence[tuple[str, Any]], tasks: Optional[AgentTasks]) -> None:
    """Refuse a reward term that scores episodes (``needs = "episodes"`` or ``"environment"``) when
    rollouts are single completions (``tasks`` None), or one that needs an environment when some
    row runs without one."""
    for name, fn in terms:
        needs = getattr(fn, "needs", None)
        if needs in ("episodes", "environment") and tasks is None:
            raise UserError(f"reward {name} scores agent episodes, but RL samples single completions here; "
                            "pass task rows with tools and --episodes auto|on, or drop the reward")
        if needs == "environment" and not tasks.every_row_has_environment():
            raise UserError(f"reward {name} scores an environment's state, but some task rows run without "
                            "one; pass --environment module:Class or an 'environment' column in every row")


@functools.lru_cache(maxsize=16)
def _environment_class(spec: str) -> type:
    return load_environment(spec)


@dataclass
class Episode:
    """One episode as the policy lived it."""

    prompt: str
    """The task's prompt (what rewards look its row up by)."""
    ids: list[int]
    """The first prompt's ids, then every id fed after it, sampled or inserted."""
    prompt_length: int
    sampled: list[bool]
    """Per id after the prompt: the policy sampled it (True) or the runtime inserted it (False)."""
    answer: str
    """The final answer's text: the completion rewards score."""
    calls: list[dict]
    """Every call made: ``{name, arguments, ok, content}`` (``ok`` false for a call that did not
    parse, validate or run)."""
    rounds: int
    truncated: bool
    """The final answer hit the token budget, or the conversation outgrew the context."""
    messages: list[dict]
    environment: Any = None
    drawn_logprobs: list[float] = field(default_factory=list)
    """Per id after the prompt: the sampler's log-probability of a sampled id, 0 for an inserted one."""
    rerendered: bool = False
    """A round's prompt was rendered anew rather than extended: ``ids`` stop before it and hold
    none of the final answer's ids, so the episode trains nothing (:func:`pack`)."""
    round_tokens: list[int] = field(default_factory=list)
    """The ids the policy sampled in each round (its tool rounds, then the final answer), as far as
    ``ids`` go: what lengths count (the runtime's inserted tool results count for nothing)."""

    def view(self) -> dict:
        """What a reward sees of the episode (``episodes=``): each turn's text, the calls and their
        observations, the rounds, the truncation."""
        return {"messages": self.messages, "calls": self.calls, "rounds": self.rounds,
                "truncated": self.truncated, "answer": self.answer}


def episode_params(settings: RLSettings, seed: int, index: int) -> SamplingParams:
    """Exact sampling of the policy at the recipe's temperature, one seed per episode."""
    return SamplingParams(temperature=settings.temperature, top_p=1.0, top_k=0, min_p=0.0,
                          max_tokens=settings.max_new_tokens, seed=(seed * 1_000_003 + index) % SEED_SPAN)


def run_episode(backend, prompt: str, setup: EpisodeSetup, settings: RLSettings,
                params: SamplingParams) -> Episode:
    """One episode in the runtime's loop on ``backend`` (a :class:`PolicyBackend`, a
    :class:`~slm_align.ondevice.agent.batching.Lane` of an engine over a :class:`PolicyDecoder`, or an
    :class:`~slm_align.rl.llama_episodes.ExactLlamaBackend`); its ids from the runtime's trace, each
    sampled id's log-probability from the backend's rounds."""
    agent = Agent(backend, "policy", tools=setup.tools, sampling=params, grammar=False,
                  max_tool_rounds=settings.max_tool_rounds, describe_tools=True)  # as SFT chats and evaluate-agent
    backend.rounds = []
    for _ in agent.respond(setup.messages):
        pass
    reply = agent.last
    ids, sampled, logprobs, cut = _trace_ids(agent.trace, backend.rounds)
    rounds = sum(1 for kind, _ in agent.trace[1:] if kind != "sampled")  # a round's prompt extended or anew
    return Episode(prompt, ids, len(agent.trace[0][1]), sampled, reply.text, reply.tool_calls, rounds,
                   reply.truncated or cut, agent.messages, setup.environment, logprobs, rerendered=cut,
                   round_tokens=round_tokens(agent.trace))


def round_tokens(trace: list[tuple[str, list[int]]]) -> list[int]:
    """The ids sampled in each round of a runtime trace, up to where the runtime rendered the
    conversation anew (:func:`_trace_ids` keeps the ids up to there only)."""
    counts = []
    for kind, piece in trace[1:]:
        if kind == "prompt":
            break
        if kind == "sampled":
            counts.append(len(piece))
    return counts


def _trace_ids(trace: list[tuple[str, list[int]]],
               draws: list[list[float]]) -> tuple[list[int], list[bool], list[float], bool]:
    """The episode's ids, which of those after the first prompt were sampled, their log-probabilities
    (``draws``: one list per sampled piece, in order; 0 for inserted ids), and whether the trace was
    cut where the runtime rendered the conversation anew (it outgrew the context): the token contract
    holds up to there only."""
    ids = list(trace[0][1])
    sampled: list[bool] = []
    logprobs: list[float] = []
    rounds = iter(draws)
    for kind, piece in trace[1:]:
        if kind == "prompt":
            return ids, sampled, logprobs, True
        ids += piece
        sampled += [kind == "sampled"] * len(piece)
        logprobs += list(next(rounds)) if kind == "sampled" else [0.0] * len(piece)
        if len(logprobs) != len(sampled):
            raise RuntimeError("the sampler drew another number of ids than the runtime fed")
    return ids, sampled, logprobs, False


def collect_episodes(models: RolloutModels, prompts: list[str], settings: RLSettings, seed: int,
                     tasks: AgentTasks, clock: Optional[PhaseClock] = None,
                     passes: Passes = Passes()) -> Rollout:
    """One episode per prompt (``seed``), scored, with the log-probability passes the algorithm uses
    (see :func:`~slm_align.rollouts.completions.collect`; the same arguments besides ``tasks``;
    ``passes.old_from_sampler`` does not apply). ``models.sampler`` (a
    :class:`~slm_align.rl.llama_sampler.LlamaSampler`): the runtime's llama.cpp backend runs the
    episodes, the current LoRA swapped in first, and its log-probabilities are kept."""
    clock = clock or PhaseClock()
    policy = models.policy
    sampler = models.sampler
    policy.eval()
    if sampler is None:
        with clock.phase("sampling"), merged_for_sampling(policy):
            episodes = run_episodes(policy, models.tokenizer, prompts, settings, seed, tasks)
    else:
        with clock.phase("sampler_sync"):
            sampler.refresh(policy)
        with clock.phase("sampling"):
            runner = sampler.episode_runner(len(prompts))
            episodes = backend_episodes(runner, prompts, settings, seed, tasks)
    input_ids, attention, width, mask = pack(episodes, models.tokenizer.pad_token_id,
                                             device_of(policy))
    packed = Packed(input_ids, attention, width)
    old, ref, values = scoring_passes(policy, models.value_head, packed, settings, clock, passes)
    device = input_ids.device
    truncated = torch.tensor([e.truncated for e in episodes], device=device)
    with clock.phase("reward"):
        raw = episode_scores(models.reward_fn, prompts, episodes)
    rounds = [e.round_tokens for e in episodes]
    scores, mask = truncation_rules(torch.tensor(raw, device=device), mask, truncated, settings,
                                    rounds)
    drawn = None
    if sampler is not None:
        drawn = sampler_logprobs(episodes, mask.shape[1], mask.device)
    rollout = Rollout(prompts, [e.answer for e in episodes], input_ids, attention, width, mask, old,
                      ref, values, scores, truncated, sampler_logprobs=drawn, round_tokens=rounds)
    rollout.stats = episode_stats(episodes, tasks.tasks)
    return rollout


def run_episodes(model, tokenizer, prompts: list[str], settings: RLSettings, seed: int,
                 tasks: AgentTasks) -> list[Episode]:
    """One episode per prompt on ``model`` (the policy as sampling sees it) through PyTorch, all of them at
    once: a :class:`~slm_align.rollouts.policy_decoder.PolicyDecoder` with a slot per episode (at most
    :data:`MAX_SLOTS`) stepped by one engine (:func:`backend_episodes`)."""
    decoder = PolicyDecoder(model, tokenizer, slots=max(1, min(len(prompts), MAX_SLOTS)),
                            chat_template=tasks.chat_template)
    return backend_episodes(decoder, prompts, settings, seed, tasks)


def backend_episodes(backend, prompts: list[str], settings: RLSettings, seed: int,
                     tasks: AgentTasks) -> list[Episode]:
    """One episode per prompt, episode i drawn with the i-th seed of :func:`episode_params`. ``backend``: a
    batching :class:`~slm_align.ondevice.agent.batching.Decoder` (every episode on a lane of one
    :class:`~slm_align.ondevice.agent.batching.Engine`, as many at once as it has slots), or a one-conversation
    backend (the episodes one after another)."""
    with counted("episodes", len(prompts), "agent episodes") as count:  # shown by the gate and held-out reward
        if is_decoder(backend):
            return _engine_episodes(backend, prompts, settings, seed, tasks, count)
        episodes = []
        for i, prompt in enumerate(prompts):
            params = episode_params(settings, seed, i)
            episodes.append(run_episode(backend, prompt, tasks.open(prompt), settings, params))
            count.advance()
        return episodes


def is_decoder(backend) -> bool:
    """``backend`` steps many slots (a :class:`~slm_align.ondevice.agent.batching.Decoder`), not one conversation."""
    return hasattr(backend, "step") and hasattr(backend, "slots")


def _engine_episodes(decoder, prompts: list[str], settings: RLSettings, seed: int, tasks: AgentTasks,
                     count) -> list[Episode]:
    """The episodes on lanes of one engine over ``decoder`` (:func:`~slm_align.ondevice.agent.batching.run_many`)."""
    lock = threading.Lock()

    def one(lane, item: tuple[int, str]) -> Episode:
        index, prompt = item
        return run_episode(lane, prompt, tasks.open(prompt), settings, episode_params(settings, seed, index))

    def advance() -> None:
        with lock:
            count.advance()

    with Engine(decoder) as engine:
        return run_many(engine, list(enumerate(prompts)), one, on_done=advance)


def episode_rewards(policy, tokenizer, reward_fn, prompts: list[str], settings: RLSettings, seed: int,
                    tasks: AgentTasks, adapter: bool = True) -> list[float]:
    """The reward of one episode per prompt sampled with ``seed``, the RL adapter on (folded in for
    speed) or off (the prior): the episodes' counterpart of
    :func:`~slm_align.envelope.policy.policy_rewards`."""
    policy.eval()
    context = merged_for_sampling(policy) if adapter else policy.disable_adapter()
    with context:
        episodes = run_episodes(policy, tokenizer, prompts, settings, seed, tasks)
    return episode_scores(reward_fn, prompts, episodes)


def pack(episodes: list[Episode], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """``(input_ids, attention_mask, prompt_width, mask)``: prompts left-padded to the widest, the
    rest right-padded; ``mask`` (B, T) is 1 on sampled ids only, and 0 on the whole row of an episode
    whose context was rendered anew (``rerendered``: its answer, which the reward scores, is not in
    the row)."""
    width = max(e.prompt_length for e in episodes)
    length = max(len(e.ids) - e.prompt_length for e in episodes)
    input_ids = torch.full((len(episodes), width + length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(episodes), width + length), dtype=torch.long)
    mask = torch.zeros((len(episodes), length), dtype=torch.float32)
    for row, episode in enumerate(episodes):
        prompt = episode.ids[:episode.prompt_length]
        rest = episode.ids[episode.prompt_length:]
        start = width - len(prompt)
        input_ids[row, start:width + len(rest)] = torch.tensor(prompt + rest)
        attention[row, start:width + len(rest)] = 1
        if not episode.rerendered:
            mask[row, :len(rest)] = torch.tensor(episode.sampled, dtype=torch.float32)
    return input_ids.to(device), attention.to(device), width, mask.to(device)


def sampler_logprobs(episodes: list[Episode], length: int, device) -> torch.Tensor:
    """(B, T) the sampler's log-probability of each sampled id, laid out as :func:`pack` lays out the
    ids (0 on inserted ids and padding, which the mask leaves out)."""
    out = torch.zeros((len(episodes), length), dtype=torch.float32)
    for row, episode in enumerate(episodes):
        out[row, :len(episode.drawn_logprobs)] = torch.tensor(episode.drawn_logprobs, dtype=torch.float32)
    return out.to(device)


def episode_scores(reward_fn, prompts: list[str], episodes: list[Episode]) -> list[float]:
    """The reward of each episode: its final answer is the completion; the episodes themselves
    arrive as ``episodes=`` and their environments as ``environments=`` (TRL's convention)."""
    scores = reward_fn(prompts, [e.answer for e in episodes], truncated=[e.truncated for e in episodes],
                       episodes=[e.view() for e in episodes], environments=[e.environment for e in episodes])
    scores = [float(s) for s in scores]
    if any(s != s or s in (float("inf"), float("-inf")) for s in scores):
        raise UserError("a reward gave a NaN or infinite score for an episode; make it return finite numbers")
    return scores


def episode_stats(episodes: list[Episode], tasks: TaskSet) -> dict[str, float]:
    """The iteration's agent metrics: the share of episodes that called a tool (a call the runtime
    ran, or one left in the final answer's text: with ``max_tool_rounds`` 0 the calls are the
    answer and nothing runs them), the share of the calls run that parsed, validated and ran, and
    the counts behind both (the watchdog tests counts, not rates), tool rounds per episode, the
    share of episodes left untrained because a round's context was rendered anew, and, when the
    rows have an ``answer``, the share of episodes whose final answer is right (the runtime's
    success rule)."""
    calls = [call for e in episodes for call in e.calls]
    calling = sum(1 for e in episodes if e.calls or reply_calls(e.answer))
    valid = sum(1 for c in calls if c["ok"])
    stats = {"episode/call_rate": calling / len(episodes),
             "episode/valid_call_rate": valid / len(calls) if calls else float("nan"),
             "episode/count": float(len(episodes)), "episode/with_calls": float(calling),
             "episode/calls": float(len(calls)), "episode/valid_calls": float(valid),
             "episode/rounds": sum(e.rounds for e in episodes) / len(episodes),
             "episode/rerendered": sum(e.rerendered for e in episodes) / len(episodes)}
    answers = [tasks.row(e.prompt).get("answer") for e in episodes]
    if all(answer is not None for answer in answers):
        verdicts = [classify(e.calls, e.answer, str(answer), tasks.row(e.prompt).get("tool"))
                    for e, answer in zip(episodes, answers)]
        stats["episode/success"] = sum(v == "success" for v in verdicts) / len(episodes)
    return stats
