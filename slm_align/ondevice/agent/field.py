"""``slm-align field simulate``: a fleet of simulated devices, before anything ships.

Each of ``devices`` devices answers ``turns_per_device`` held-out task rows in the runtime
(:class:`Agent` over the artifact, each row a new conversation run by
:func:`~slm_align.ondevice.agent.task_eval.run_task`, so calculator rows run their tools and
function rows are answered in one reply) and records every turn in its own preference store
(``OUT/device-001.db``, ...) through the real API: ``Agent(store=..., consent=True)`` and
``agent.feedback(...)``. The stores are the files a real fleet sends: ``feedback export`` reads
each, ``feedback collect`` merges them (the file name names the device), and with a candidate
``feedback ab OUT/*.db`` decides the fleet's A/B test.

The user of each device is scripted (:class:`ScriptedUser`): the task's own checker judges the
answer (``classify`` for calculator rows, BFCL's rules of
:mod:`~slm_align.ondevice.agent.function_eval` for function rows: the verdict ``run_task`` returns),
a right call or answer gets a thumbs up and a wrong one a thumbs down; then a share ``unrated`` of
the turns gets no rating and a share ``noise`` of the rated ones is flipped, each drawn
independently per turn.

Seeds: device ``d`` draws from ``random.Random("field:<seed>:<d>")`` its tasks (the rows shuffled,
again after each pass: every row once before any twice), its user's draws and, when ``temperature``
> 0, the sampler's seed of each turn. With a candidate (``candidate=`` adapter GGUFs made for the
artifact's base), a device runs the embedded runtime's A/B test
(:class:`~slm_align.ondevice.agent.ab_trial.DeviceRouter`, as ``Agent.load(..., candidate=...)``
does): each conversation is routed by a keyed hash of an id the trial signs with a random key (a
client cannot choose its arm, so neither can a seed); which arm answered is therefore not
reproducible, everything else is. Each device's trial decides alone in its store as a phone does;
the fleet decision pools them.

Torch-free, like the runtime.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from slm_align.atomic import building_directory
from slm_align.errors import UserError
from slm_align.ondevice.agent.ab_trial import Candidate, DeviceRouter, check_share
from slm_align.ondevice.agent.artifact_forms import ArtifactForm, is_adapter_gguf, resolve_artifact
from slm_align.ondevice.agent.loading import Model
from slm_align.ondevice.agent.runtime import Agent, fold_seed
from slm_align.ondevice.agent.settings import (
    ChatSettings,
    Recording,
    SamplingParams,
    refuse_unknown,
    take_options,
)
from slm_align.ondevice.agent.store import PreferenceStore
from slm_align.ondevice.agent.task_eval import (
    check_artifact_exists,
    load_checked,
    load_tasks,
    run_task,
)
from slm_align.ondevice.agent.task_settings import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TOOL_ROUNDS,
    check_settings,
)
from slm_align.ondevice.tools.builtin import default_tools
from slm_align.progress import counted, stage_lines
from slm_align.runs import check_out_dir, sha256_file
from slm_align.stats import wilson_interval

DEFAULT_DEVICES = 8
DEFAULT_TURNS = 20
DEFAULT_NOISE = 0.1
"""A guess at how often a real user's thumb disagrees with the checker; set what your app sees."""
DEFAULT_UNRATED = 0.3
"""A guess at how often a real user rates nothing; set what your app sees."""


@dataclass(frozen=True)
class FieldSettings:
    """How the simulated fleet runs (checked by :meth:`check` before anything is opened or
    written)."""

    devices: int = DEFAULT_DEVICES
    """Simulated devices, each with its own store, user and seed."""
    turns_per_device: int = DEFAULT_TURNS
    """Conversations per device, each one task drawn for that device."""
    noise: float = DEFAULT_NOISE
    """Share of rated turns whose thumb is flipped."""
    unrated: float = DEFAULT_UNRATED
    """Share of turns left without a rating."""
    candidate: tuple = ()
    """Adapter GGUFs A/B-tested against the artifact's adapters (none: no A/B test), or one
    manifest, bundle or BASE+ADAPTER chain on the same base (:func:`candidate_chain`)."""
    candidate_share: float = 0.5
    """Share of conversations the candidate answers while a device's A/B test collects."""
    seed: int = 0
    """Seed of each device's tasks, its user's ratings and its sampling."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    """Most tokens per model reply."""
    max_tool_rounds: int = DEFAULT_TOOL_ROUNDS
    """Tool rounds a turn may take before its final answer."""
    temperature: float = 0.0
    """0: greedy answers; above: sampled, each turn with its own seed."""

    def check(self) -> None:
        """One line for the first setting out of its bounds."""
        counts = (("--devices", self.devices), ("--turns-per-device", self.turns_per_device))
        for flag, value in counts:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{flag} must be an integer >= 1, got {value}")
        for flag, value in (("--noise", self.noise), ("--unrated", self.unrated)):
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not 0 <= value <= 1:
                raise UserError(f"{flag} is a share of turns: a number from 0 to 1, got {value}")
        check_settings(1, self.temperature, self.max_tool_rounds, self.max_tokens)
        if self.candidate:
            check_share(self.candidate_share)
        for path in self.candidate:
            if not Path(path).exists() and "+" not in str(path):
                raise UserError(f"candidate adapter {path} not found; pass a LoRA adapter GGUF "
                                "made for the artifact's base (`export --target gguf-adapter`), "
                                "or its manifest or bundle")


@dataclass(frozen=True)
class Rating:
    """What a scripted user did with one answer."""

    up: Optional[bool]
    """True: thumbs up, False: down, None: no rating."""
    flipped: bool = False
    """The thumb is the opposite of the checker's verdict (noise)."""


class ScriptedUser:
    """Rates answers as the task's checker judges them, with a share of noise and of unrated turns.

    Per turn two uniform draws u1, u2 in [0, 1): unrated when u1 < ``unrated``; else up = success
    XOR (u2 < ``noise``). Both are drawn on every turn, so the same seed leaves the same turns
    unrated whatever the noise.
    """

    def __init__(self, rng: random.Random, noise: float, unrated: float):
        self.rng = rng
        self.noise = noise
        self.unrated = unrated

    def rate(self, success: bool) -> Rating:
        skip = self.rng.random() < self.unrated
        flip = self.rng.random() < self.noise
        if skip:
            return Rating(None)
        return Rating(success != flip, flip)


def device_rng(seed: int, device: int) -> random.Random:
    """Device ``device``'s own random stream (string seeds hash with SHA-512: stable across
    runs)."""
    return random.Random(f"field:{seed}:{device}")


def assign_tasks(rows: int, turns: int, rng: random.Random) -> list[int]:
    """``turns`` row indices: the rows shuffled, reshuffled after each pass."""
    picks: list[int] = []
    while len(picks) < turns:
        block = list(range(rows))
        rng.shuffle(block)
        picks.extend(block)
    return picks[:turns]


def candidate_chain(candidate: Sequence[Union[str, Path]], current: ArtifactForm) -> tuple[Path, ...]:
    """The candidate's adapters, applied in order on the artifact's base: adapter GGUFs as given, or
    the adapters of one artifact form (an adapter export's manifest, a bundle folder,
    ``BASE+ADAPTER...``) whose base is the artifact's own (same sha256): a round's update A/B-tested
    as it ships."""
    paths = [Path(str(path)) for path in candidate]
    if not paths or all(path.is_file() and is_adapter_gguf(path) for path in paths):
        return tuple(paths)
    if len(paths) > 1:
        raise UserError("pass one --candidate that is a manifest, bundle or BASE+ADAPTER chain, or only "
                        "adapter GGUFs (repeat --candidate to chain them)")
    form = resolve_artifact(candidate[0])
    if not form.adapters:
        raise UserError(f"--candidate {candidate[0]} holds no adapter; pass an adapter export's manifest, "
                        "a base + adapters bundle or adapter GGUFs")
    if sha256_file(form.model) != sha256_file(current.model):
        raise UserError(f"--candidate {candidate[0]} is made for another base than --artifact ({form.model} "
                        f"is not {current.model}); export the candidate from the same base")
    return form.adapters


def device_name(device: int, devices: int) -> str:
    """``device-001``: numbered from 1, zero-padded to the fleet's width (at least 3 digits)."""
    return f"device-{device:0{max(3, len(str(devices)))}d}"


def _arm(agent: Agent) -> str:
    """Which arm answered the last turn: ``candidate`` when its adapters were on, else
    ``current``."""
    if agent.ab is not None and agent.model_id == agent.ab.trial.candidate_id:
        return "candidate"
    return "current"


def device_agent(model: Model, store: PreferenceStore, settings: FieldSettings,
                 current: Sequence[Path]) -> Agent:
    """A device's agent: the shared model, its own store (consented turns), greedy or sampled
    answers, and with a candidate the A/B router ``Agent.load(..., candidate=...)`` sets up."""
    sampling = SamplingParams(temperature=settings.temperature, max_tokens=settings.max_tokens)
    chat = ChatSettings(sampling=sampling, max_tool_rounds=settings.max_tool_rounds,
                        describe_tools=True)
    recording = Recording(store, consent=True)
    agent = Agent(model.backend, model.sha256, default_tools(), chat, recording)
    if settings.candidate:
        trial = Candidate(tuple(Path(p) for p in settings.candidate), settings.candidate_share)
        agent.ab = DeviceRouter(agent, list(current), trial)
    return agent


def run_device(agent: Agent, rows: Sequence[dict], rng: random.Random, settings: FieldSettings) -> list[dict]:
    """One device's turns, each a new conversation rated by its scripted user:
    ``{task, arm, success, up, flipped}`` each."""
    tasks = assign_tasks(len(rows), settings.turns_per_device, rng)
    seeds = [rng.randrange(2 ** 32) for _ in tasks]
    user = ScriptedUser(rng, settings.noise, settings.unrated)
    turns = []
    for task, seed in zip(tasks, seeds):
        agent.reset()  # a new conversation (routed to an arm under an A/B test)
        sampling = {"seed": fold_seed(seed)} if settings.temperature > 0 else None
        result = run_task(agent, rows[task], task, 0, sampling)
        rating = user.rate(result.success)
        if rating.up is not None:
            agent.feedback("up" if rating.up else "down")
        turns.append({"task": task, "arm": _arm(agent), "success": result.success, "up": rating.up,
                      "flipped": rating.flipped})
    return turns


def _counts(turns: Sequence[dict]) -> dict:
    """Turns, rated, ups, downs, flipped and successes of some turns."""
    rated = [turn for turn in turns if turn["up"] is not None]
    return {"turns": len(turns), "rated": len(rated), "ups": sum(turn["up"] for turn in rated),
            "downs": sum(not turn["up"] for turn in rated), "flipped": sum(turn["flipped"] for turn in rated),
            "successes": sum(turn["success"] for turn in turns)}


def arm_figures(turns: Sequence[dict]) -> dict:
    """Per arm: the counts, the task success rate (the checker's, before noise) and its Wilson 95%
    interval."""
    arms = {}
    for name in sorted({turn["arm"] for turn in turns}):
        counts = _counts([turn for turn in turns if turn["arm"] == name])
        arms[name] = {**counts, "success_rate": counts["successes"] / counts["turns"],
                      "success_ci95": list(wilson_interval(counts["successes"], counts["turns"]))}
    return arms


def check_out(out: Path, inputs: Sequence[Path], overwrite: bool) -> None:
    """``out`` is new, empty, or replaced with ``overwrite``; never an input's folder."""
    check_out_dir(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out} exists and is not empty; pass --overwrite to replace it or choose another")
    for path in inputs:
        resolved = Path(str(path)).resolve()
        if resolved == out.resolve() or out.resolve() in resolved.parents:
            raise UserError(f"input {path} is inside --out {out}; pass another --out")


def simulate_field(artifact: Union[str, Path], tasks: Union[str, Path], out: Union[str, Path],
                   settings: FieldSettings = FieldSettings(), limit: Optional[int] = None,
                   threads: Optional[int] = None, overwrite: bool = False, **options: Any) -> dict:
    """Run the simulated devices ``settings`` describe on the task rows of ``tasks`` (see the module
    docstring; ``limit``: the first rows only, ``threads``: the backend's) and write one preference
    store per device into the folder ``out``; returns the summary (also ``out/summary.json``).
    ``options``: any field of :class:`FieldSettings` by name (``devices=8, noise=0.1, ...``),
    replacing ``settings``'. Settings, paths, tasks and the artifact are checked before anything is
    written: bad input is a one-line UserError and leaves ``out`` as it was."""
    settings = take_options(settings, options)
    refuse_unknown("simulate_field", options)
    settings = replace(settings, candidate=tuple(settings.candidate))
    settings.check()
    out = Path(out)
    check_artifact_exists(artifact)
    parts = [Path(p) for p in str(artifact).split("+")]
    check_out(out, [Path(tasks), *parts, *map(Path, settings.candidate)], overwrite)
    rows = load_tasks(tasks, limit)
    form = resolve_artifact(artifact)
    settings = replace(settings, candidate=candidate_chain(settings.candidate, form))
    model = load_checked(artifact, threads)
    current = form.adapters
    plan = (f"{settings.devices} device(s) x {settings.turns_per_device} turn(s) on "
            f"{len(rows)} task(s)")
    with building_directory(out, replace=True) as scratch:
        with stage_lines("field simulate", plan) as stage:
            fleet = _run_fleet(model, rows, settings, current, scratch)
            stage.figures = f"{sum(len(d['turns']) for d in fleet)} turns"
        summary = _summary(fleet, settings, artifact, tasks, len(rows))
        text = json.dumps(summary, indent=2) + "\n"
        (scratch / "summary.json").write_text(text, encoding="utf-8")
    return dict(summary, out=str(out))


def _run_fleet(model: Model, rows: Sequence[dict], settings: FieldSettings, current: Sequence[Path],
               folder: Path) -> list[dict]:
    """Every device in turn, each into its own store in ``folder``: ``{device, file, turns, ab}``
    each."""
    fleet = []
    with counted("devices", settings.devices, "devices") as count:
        for device in range(1, settings.devices + 1):
            name = device_name(device, settings.devices)
            with PreferenceStore(folder / f"{name}.db") as store:
                agent = device_agent(model, store, settings, current)
                turns = run_device(agent, rows, device_rng(settings.seed, device), settings)
                state = agent.ab.trial.state if agent.ab is not None else None
                ids = (agent.ab.trial.current_id, agent.ab.trial.candidate_id) if agent.ab is not None else None
            fleet.append({"device": name, "file": f"{name}.db", "turns": turns, "ab": state, "ids": ids})
            count.advance()
    return fleet


def _summary(fleet: list[dict], settings: FieldSettings, artifact, tasks, n_tasks: int) -> dict:
    """The fleet's figures: settings, totals, per arm, per device, and the devices' own A/B
    states."""
    turns = [turn for device in fleet for turn in device["turns"]]
    totals = _counts(turns)
    ab = None
    if settings.candidate:
        current_id, candidate_id = fleet[0]["ids"]
        ab = {"current_id": current_id, "candidate_id": candidate_id, "candidate": [str(p) for p in settings.candidate],
              "candidate_share": settings.candidate_share,
              "device_decisions": dict(Counter(device["ab"] for device in fleet))}
    return {"artifact": str(artifact), "tasks": str(tasks), "n_tasks": n_tasks, "devices": len(fleet),
            "turns_per_device": settings.turns_per_device, "noise": settings.noise, "unrated": settings.unrated,
            "seed": settings.seed, "temperature": settings.temperature,
            **totals, "unrated_turns": totals["turns"] - totals["rated"],
            "arms": arm_figures(turns), "ab": ab,
            "stores": [{"device": device["device"], "file": device["file"], **_counts(device["turns"]),
                        "ab": device["ab"]} for device in fleet]}
