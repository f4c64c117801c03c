"""Agent episodes as RL rollouts: run by the runtime's own loop on the policy, trained token for token.

A scripted tiny model makes the episodes known in advance: a wrapper adds +30 to the logit of the
token a script names after the ids so far (a function of the ids alone, so the cached sampler and
the training forward see the same distribution), which makes the policy call a tool, read the
observation and answer. The real tiny model (no script) checks the sampler's exactness and a
whole GRPO iteration on episodes.
"""

from pathlib import Path

import pytest
import torch

from slm_align.config import LoraSettings, RLSettings
from slm_align.data.tasks import TaskSet
from slm_align.envelope.logprobs import forward_logprobs
from slm_align.envelope.policy import build_policy
from slm_align.errors import UserError
from slm_align.modeling.models import resolve_source
from slm_align.ondevice.agent.prompt import turn_end
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.rewards.builtin import combine
from slm_align.ondevice.rewards.columns import with_columns
from slm_align.ondevice.tools.builtin import calculator, default_tools
from slm_align.ondevice.tools.registry import ToolRegistry
from slm_align.rl.grpo import GRPO
from slm_align.rl.learner import RolloutSource
from slm_align.rollouts.completions import Passes
from slm_align.rollouts.episodes import (
    AgentTasks,
    Episode,
    EpisodeSetup,
    agent_tasks,
    check_episode_rewards,
    check_episode_settings,
    episode_params,
    episode_stats,
    pack,
    run_episode,
)
from slm_align.rollouts.policy_backend import PolicyBackend

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
ANSWER = "The answer is 5."
BIAS = 30.0


class Scripted(torch.nn.Module):
    """A causal LM whose next-token logits get +BIAS on the token the script names: in the
    assistant turn being written, the next id of ``calls[k]`` (k = the calls already made) or, after
    them, of the answer, each followed by the template's end of turn. A function of the ids alone."""

    def __init__(self, model, tokenizer, opening: str, end_id: int, calls: list[str], answer: str = ANSWER):
        super().__init__()
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.opening = opening
        self.calls = calls
        self.targets = [tokenizer(text, add_special_tokens=False)["input_ids"] + [end_id] for text in calls + [answer]]
        self.history: list[int] = []

    def get_output_embeddings(self):
        return None  # logits that are more than a projection: scored from the model's own logits

    def forced(self, ids: list[int]):
        """The id the script names after ``ids`` (None outside a scripted turn)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        start = text.rfind(self.opening)
        if start < 0:
            return None
        before, produced = text[:start], text[start + len(self.opening):]
        made = sum(before.count(call) for call in set(self.calls))
        target = self.targets[min(made, len(self.calls))]
        for k in range(len(target)):
            if self.tokenizer.decode(target[:k], skip_special_tokens=False) == produced:
                return target[k]
        return None

    def forward(self, input_ids, attention_mask=None, past_key_values=None, logits_to_keep=0, **kwargs):
        cached = past_key_values.get_seq_length() if past_key_values is not None else 0  # before the forward adds
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                         logits_to_keep=logits_to_keep, **kwargs)
        rows = input_ids.tolist()
        if cached > 0:  # the ids the cache holds (cropped to a prefix when a prompt was rendered anew)
            rows = [self.history[:cached] + rows[0]]
        if len(rows) == 1 and kwargs.get("use_cache"):
            self.history = rows[0]
        logits = out.logits.clone()
        kept = logits.shape[1]
        for b, row in enumerate(rows):
            attended = [1] * len(row) if attention_mask is None else attention_mask[b].tolist()
            for j in range(kept):
                index = len(row) - kept + j
                if index < 0 or not attended[index]:
                    continue
                token = self.forced([i for i, m in zip(row[:index + 1], attended) if m])
                if token is not None:
                    logits[b, j, token] += BIAS
        out.logits = logits
        return out


def tiny(tiny_models, arch="llama"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()


def settings(**update) -> RLSettings:
    base = dict(algo="grpo", prompts_per_step=2, group_size=2, max_new_tokens=40, minibatch_size=4, epochs=1,
                max_tool_rounds=2, lora=LoraSettings(r=8, alpha=16.0, dropout=0.0))
    return RLSettings(**{**base, **update})


class Recording(PolicyBackend):
    """The policy backend, keeping the sampler's log-probability of every id it drew."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drawn: list[tuple[int, float]] = []

    def generate(self, prompt, params, grammar=None):
        for token in super().generate(prompt, params, grammar):
            self.drawn.append((token, self.drawn_logprobs[-1]))
            yield token


def calculator_only() -> ToolRegistry:
    registry = ToolRegistry()
    registry.register(calculator)
    return registry


def template(name):
    return None if name is None else (TEMPLATES / name).read_text()


def opening_of(backend) -> str:
    """The text a template opens an assistant's turn with (its generation prompt)."""
    from slm_align.ondevice.templates.chat import render

    plain = render(backend.chat_template, [{"role": "user", "content": "x"}], add_generation_prompt=False,
                   bos_token=backend.bos_token, eos_token=backend.eos_token)
    prompted = render(backend.chat_template, [{"role": "user", "content": "x"}], add_generation_prompt=True,
                      bos_token=backend.bos_token, eos_token=backend.eos_token)
    return prompted[len(plain):]


def scripted_episode(tiny_models, tokenizer, chat_template=None, calls=(CALL,), tools=None, rounds=2):
    backend = Recording(tiny(tiny_models), tokenizer, chat_template=chat_template, n_ctx=4096)  # RoPE: any length
    end = min(turn_end(backend) or {tokenizer.eos_token_id})  # where the runtime stops a turn
    backend.model = Scripted(backend.model, tokenizer, opening_of(backend), end, list(calls))
    setup = EpisodeSetup([{"role": "user", "content": "What is 2+3?"}], tools or calculator_only())
    rl = settings(max_tool_rounds=rounds, max_new_tokens=96)
    episode = run_episode(backend, "What is 2+3?", setup, rl, episode_params(rl, 0, 0))
    return backend, episode


@pytest.mark.parametrize("name", [None, "qwen2.5-instruct.jinja", "qwen3.jinja", "smollm2-135m-instruct.jinja",
                                  "llama-3.2-instruct.jinja"])
def test_an_episode_is_the_runtimes_loop_and_its_ids_are_those_fed(tiny_models, tokenizer, name):
    backend, episode = scripted_episode(tiny_models, tokenizer, template(name))
    assert [call["name"] for call in episode.calls] == ["calculator"] and episode.calls[0]["ok"]
    assert episode.calls[0]["content"] == "5"
    assert episode.answer == ANSWER and episode.rounds == 1 and not episode.truncated
    # The same messages through the runtime's own Agent (the scripted model, a fresh cache) feed the same ids.
    rl = settings(max_new_tokens=96)
    agent = Agent(backend, "policy", tools=calculator_only(), sampling=episode_params(rl, 0, 0), grammar=False,
                  max_tool_rounds=2, describe_tools=True)  # as RL runs it (the tools fallback)
    backend.reset()
    list(agent.respond([{"role": "user", "content": "What is 2+3?"}]))
    fed = [i for _, piece in agent.trace for i in piece]
    assert episode.ids == fed
    rest = episode.ids[episode.prompt_length:]
    sampled = [i for i, s in zip(rest, episode.sampled) if s]
    inserted = [i for i, s in zip(rest, episode.sampled) if not s]
    assert sampled == [token for token, _ in backend.drawn[:len(sampled)]]
    text = tokenizer.decode(inserted, skip_special_tokens=False)
    assert "5" in text and CALL not in text and ANSWER not in text  # the observation, never the model's words
    end = tokenizer.decode(sampled[-1:], skip_special_tokens=False)
    assert tokenizer.decode(sampled, skip_special_tokens=False) == f"{CALL}{end}{ANSWER}{end}"


REASONING = "I add two and three with the calculator, one step after the other, to be sure of the sum. " * 3
CALL_SHOWN = '"arguments": {"expression": "2+3"}'
"""What both the sampled call and a template's own rendering of it hold: a call counts as made once it is in the
context, in whichever form."""


def reasoning_dropped() -> str:
    """Qwen2.5's template without the text of earlier call turns (the reasoning before a call), as templates that
    strip earlier reasoning (Qwen3's, DeepSeek-R1's) render history."""
    full = template("qwen2.5-instruct.jinja")
    text = """        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
"""
    assert full.count(text) == 1
    return full.replace(text, "")


def reasoning_episode(tiny_models, tokenizer, n_ctx: int):
    """The scripted policy reasons, calls the calculator and answers, in a context of ``n_ctx`` positions."""
    backend = Recording(tiny(tiny_models), tokenizer, chat_template=reasoning_dropped(), n_ctx=n_ctx)
    end = min(turn_end(backend) or {tokenizer.eos_token_id})
    backend.model = Scripted(backend.model, tokenizer, opening_of(backend), end, [REASONING + CALL])
    backend.model.calls = [CALL_SHOWN]
    setup = EpisodeSetup([{"role": "user", "content": "What is 2+3?"}], calculator_only())
    rl = settings(max_tool_rounds=2, max_new_tokens=160)
    return run_episode(backend, "What is 2+3?", setup, rl, episode_params(rl, 0, 0))


def test_an_episode_whose_context_is_rendered_anew_trains_nothing_and_is_counted(tiny_models, tokenizer):
    """Where the extended ids outgrow the context but the template's rendering (the reasoning dropped) fits, the
    runtime renders the prompt anew: the trained ids stop before the answer the reward scores, so the episode's
    mask row is 0, not 1 on the call's tokens, and ``episode/rerendered`` counts it."""
    roomy = reasoning_episode(tiny_models, tokenizer, 4096)
    assert not roomy.rerendered and roomy.answer == ANSWER and roomy.rounds == 1
    inserted = roomy.sampled.index(False)
    answer_starts = roomy.prompt_length + roomy.sampled.index(True, inserted)  # the second round's prompt length
    tight = reasoning_episode(tiny_models, tokenizer, answer_starts + 160 - 1)  # one position short of extending
    assert tight.rerendered and tight.answer == ANSWER and tight.rounds == 1
    assert len(tight.ids) < len(roomy.ids) and tight.ids == roomy.ids[:len(tight.ids)]  # cut where it was rendered
    _, attention, width, mask = pack([roomy, tight], tokenizer.pad_token_id, "cpu")
    assert mask[0].sum() == sum(roomy.sampled) and mask[1].sum() == 0 and attention[1, width:].sum() > 0
    stats = episode_stats([roomy, tight], TaskSet(["What is 2+3?"], [{}]))
    assert stats["episode/rerendered"] == 0.5 and stats["episode/rounds"] == 1.0


def test_a_template_that_cannot_show_tool_results_is_refused_before_any_episode(tokenizer):
    tasks = AgentTasks(TaskSet(["What is 2+3?"], [{"answer": "5"}]), chat_template=template("gemma-3-it.jinja"))
    with pytest.raises(UserError, match="cannot show tool results"):
        tasks.check_template(tokenizer)


def test_the_training_forward_scores_exactly_what_the_sampler_drew_across_rounds(tiny_models, tokenizer):
    backend, episode = scripted_episode(tiny_models, tokenizer, calls=(CALL, CALL))
    assert episode.rounds == 2
    input_ids, attention, width, mask = pack([episode], tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        logprobs, _, _ = forward_logprobs(backend.model, input_ids, attention, width, 1.0)
    drawn = torch.tensor([logprob for _, logprob in backend.drawn])
    assert mask.sum() == len(drawn) and (mask == 0).any()  # inserted ids sit between the sampled ones
    assert torch.allclose(logprobs[mask.bool()], drawn, atol=1e-4)
    # A one-position shift of the mask (an inserted id counted as sampled) breaks it.
    shifted = torch.roll(mask, 1, dims=1).bool()
    assert not torch.allclose(logprobs[shifted], drawn, atol=1e-2)


def test_unscripted_sampling_is_the_policys_own_distribution(tiny_models, tokenizer):
    backend = Recording(tiny(tiny_models), tokenizer)
    setup = EpisodeSetup([{"role": "user", "content": "Tell me a story."}], default_tools())
    episode = run_episode(backend, "p", setup, settings(max_new_tokens=24), episode_params(settings(), 3, 1))
    input_ids, attention, width, mask = pack([episode], tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        logprobs, _, _ = forward_logprobs(backend.model, input_ids, attention, width, 1.0)
    drawn = torch.tensor([logprob for _, logprob in backend.drawn])
    assert len(drawn) >= 5 and drawn.std() > 0.05  # real draws, not forced ones (a random model's spread little)
    assert torch.allclose(logprobs[mask.bool()], drawn, atol=1e-4)


def test_a_sampler_setting_that_is_not_the_policy_is_refused(tiny_models, tokenizer):
    from dataclasses import replace

    backend = PolicyBackend(tiny(tiny_models), tokenizer)
    with pytest.raises(UserError, match="top_k 5"):
        next(backend.generate([1, 2, 3], replace(episode_params(settings(), 0, 0), top_k=5)))


class Counter:
    """A stateful environment: a counter the episode's calls add to."""

    def reset(self, start: int = 0, **_):
        self.total = int(start)
        return f"The counter starts at {self.total}."

    def add(self, amount: int) -> str:
        """Add to the counter.

        Args:
            amount: How much to add.
        """
        self.total += amount
        return str(self.total)

    def explode(self, amount: int) -> str:
        """Fail.

        Args:
            amount: Ignored.
        """
        raise RuntimeError("the environment broke")

    def get_reward(self) -> float:
        return float(self.total)


ADD = '<tool_call>{"name": "add", "arguments": {"amount": 2}}</tool_call>'
EXPLODE = '<tool_call>{"name": "explode", "arguments": {"amount": 1}}</tool_call>'


def environment_tasks(**row) -> AgentTasks:
    columns = {"answer": "4", "environment": "tests.rollouts.test_episodes:Counter", "start": 0, **row}
    return AgentTasks(TaskSet(["Count."], [columns]), allowed_modules=("tests.rollouts", "no_such_module"))


def test_an_environment_is_reset_per_episode_and_its_methods_are_the_tools(tiny_models, tokenizer):
    tasks = environment_tasks()
    results = []
    for _ in range(2):
        setup = tasks.open("Count.")
        assert "The counter starts at 0." in setup.messages[-1]["content"]  # reset's text: the first observation
        assert sorted(setup.tools.names) == ["add", "explode"]
        _, episode = scripted_episode(tiny_models, tokenizer, calls=(ADD, ADD), tools=setup.tools)
        results.append((episode, setup.environment))
    for episode, environment in results:
        assert [call["content"] for call in episode.calls] == ["2", "4"]  # each episode from its own reset
        assert environment.total == 4
    reward = with_columns(combine(["environment_reward"]), tasks.tasks)
    assert reward(["Count."], [ANSWER], environments=[results[0][1]]) == [4.0]


def test_a_tool_that_raises_is_an_error_observation_not_a_crash(tiny_models, tokenizer):
    setup = environment_tasks().open("Count.")
    _, episode = scripted_episode(tiny_models, tokenizer, calls=(EXPLODE,), tools=setup.tools)
    assert episode.calls[0]["name"] == "explode" and not episode.calls[0]["ok"]
    assert "the environment broke" in episode.calls[0]["content"]
    assert episode.answer == ANSWER  # the episode went on to its final answer


def test_bad_environments_are_refused_in_one_line():
    with pytest.raises(UserError, match="cannot import module no_such_module"):
        environment_tasks(environment="no_such_module:Env")
    with pytest.raises(UserError, match="name it as module:Class"):
        environment_tasks(environment="Counter")
    with pytest.raises(UserError, match="no reset method"):
        environment_tasks(environment="tests.rollouts.test_episodes:NoReset")


class NoReset:
    def add(self, amount: int) -> str:
        """Add."""
        return str(amount)


class Untyped:
    def reset(self, **_):
        return None

    def add(self, amount):
        return amount


def test_an_environment_method_without_type_hints_is_refused():
    with pytest.raises(UserError, match="method add has no type hint for amount"):
        environment_tasks(environment="tests.rollouts.test_episodes:Untyped")


def test_episodes_run_when_rows_have_tools_or_when_asked():
    plain = TaskSet(["What is 2+3?"], [{"answer": "5"}])
    tooled = TaskSet(["What is 2+3?"], [{"answer": "5", "tools": [{"type": "function", "function": {
        "name": "calculator", "parameters": {"type": "object"}}}]}])
    assert agent_tasks(settings(), plain) is None
    assert agent_tasks(settings(), tooled) is not None
    assert agent_tasks(settings(episodes="on"), plain) is not None
    assert agent_tasks(settings(episodes="off"), tooled) is None
    with pytest.raises(UserError, match="agent episodes need task rows"):
        agent_tasks(settings(episodes="on"), None)
    with pytest.raises(UserError, match="reward call_format@0.2 scores agent episodes"):
        check_episode_settings(settings(episodes="off"), True, ["call_format@0.2"])
    with pytest.raises(UserError, match="reward environment_reward scores an environment's state"):
        check_episode_rewards(combine(["environment_reward"]), agent_tasks(settings(episodes="on"), plain))
    check_episode_rewards(combine(["task_success", "call_format"]), agent_tasks(settings(episodes="on"), plain))


def test_a_grpo_iteration_on_episodes_trains_the_sampled_ids_only(tiny_models, tokenizer):
    rl = settings(max_new_tokens=12)
    policy = build_policy(resolve_source(str(tiny_models["llama"])), None, rl, seed=0)
    tasks = TaskSet(["What is 2+3?", "What is 4*5?"], [{"answer": "5"}, {"answer": "20"}])
    reward = with_columns(combine(["task_success", "length_window"]), tasks)
    rollouts = RolloutSource(tasks.prompts, AgentTasks(tasks))
    loop = GRPO(policy, tokenizer, reward, rollouts, rl, seed=0)
    before = {name: p.detach().clone() for name, p in loop.named_params}
    batch = loop.collect_rollout(loop.prompts_for(0), seed=0, passes=Passes(old=False, reference=False))
    assert batch.stats["episode/success"] == 0.0
    sampled = batch.attention_mask[:, batch.prompt_width:].float()
    assert torch.all(batch.mask <= sampled)  # only ids after the prompt can train
    if batch.stats["episode/call_rate"] == 0.0:  # no call: every id after the prompt was sampled
        assert torch.equal(batch.mask, sampled)
    else:  # a random draw read as a call (the prompt lists the tools): the runtime's inserted ids do not train
        assert batch.mask.sum() < sampled.sum()
    metrics = loop.run_step(0)
    assert metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-6)  # the first ratio of an iteration is exactly 1
    assert "episode/call_rate" in metrics and "episode/rounds" in metrics
    moved = [name for name, p in loop.named_params if not torch.equal(p, before[name])]
    assert moved and all("lora" in name for name in moved)


@pytest.fixture(scope="module")
def half_caller(tmp_path_factory, tiny_models, tokenizer):
    """The tiny llama taught (full weights, a few hundred steps) to answer "What is 2+3?" in the runtime's
    prompt with the calculator call half of the time and with "5" the other half."""
    from slm_align.ondevice.agent.prompt import PromptFitter

    model = tiny(tiny_models)
    backend = PolicyBackend(model, tokenizer)
    prompt, _ = PromptFitter(backend, default_tools().specs(), describe_tools=True).fit(
        [{"role": "user", "content": "What is 2+3?"}], 64)  # as RL's episodes render it
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    replies = [tokenizer(text, add_special_tokens=False)["input_ids"] + [end] for text in (CALL, "5")]
    width = max(len(reply) for reply in replies)
    ids = torch.tensor([prompt + reply + [end] * (width - len(reply)) for reply in replies])
    labels = ids.clone()
    labels[:, :len(prompt)] = -100
    for row, reply in enumerate(replies):
        labels[row, len(prompt) + len(reply):] = -100
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(200):
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    path = tmp_path_factory.mktemp("half_caller")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def call_probability(loop, tokenizer) -> float:
    """The policy's probability that its reply to "What is 2+3?" in the runtime's prompt opens with the call
    tag (exact, from the logits: no sampling noise)."""
    from slm_align.ondevice.agent.prompt import PromptFitter

    backend = PolicyBackend(loop.policy, tokenizer)
    prompt, _ = PromptFitter(backend, default_tools().specs(), describe_tools=True).fit(
        [{"role": "user", "content": "What is 2+3?"}], 64)  # as RL's episodes render it
    loop.policy.eval()
    with torch.no_grad():
        logits = loop.policy(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    return float(logits.softmax(-1)[tokenizer.convert_tokens_to_ids("<tool_call>")])


def calls_a_tool(prompts, completions, episodes, **_):
    """1 for an episode that called a tool (a user's reward: it takes ``episodes=``)."""
    return [1.0 if episode["calls"] else 0.0 for episode in episodes]


def test_a_tiny_models_call_rate_rises_under_a_reward_that_pays_for_calling(half_caller, tokenizer):
    rl = settings(prompts_per_step=1, group_size=8, minibatch_size=8, epochs=2, max_new_tokens=48, max_tool_rounds=1)
    policy = build_policy(resolve_source(str(half_caller)), None, rl, seed=0)
    tasks = TaskSet(["What is 2+3?"], [{"answer": "5"}])
    reward = with_columns(combine(callables=[(calls_a_tool, 1.0)]), tasks)
    rollouts = RolloutSource(tasks.prompts, AgentTasks(tasks))
    loop = GRPO(policy, tokenizer, reward, rollouts, rl, seed=0)
    before = call_probability(loop, tokenizer)
    rates = [loop.run_step(step)["episode/call_rate"] for step in range(8)]
    after = call_probability(loop, tokenizer)
    assert 0.3 <= before <= 0.7  # the prior calls about half of the time
    assert after >= before + 0.04, (before, rates, after)  # 0.49 -> 0.55 measured; a flipped sign falls


QUICK = "[rl]\neval_prompts = 4\n[rl.watchdog]\nprobe_prompts = 4\n[headroom]\nspread_prompts = 4\n" \
        "max_new_tokens = 8\nmax_documents = 8\n"
SMALL = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--max-tool-rounds",
         "2", "--force", "--gate-samples", "2", "--json"]


def task_file(path: Path, n: int = 24, **extra) -> Path:
    import json

    tools = [spec for spec in default_tools().specs() if spec["function"]["name"] == "calculator"]
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} plus {i + 1}?"}], "answer": str(2 * i + 1),
             "tools": tools, **extra} for i in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def trained_metrics(run: Path) -> tuple[dict, list[dict]]:
    import json

    manifest = json.loads((run / "rl" / "manifest.json").read_text())
    lines = [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    return manifest, lines


def train_on_tasks(tmp_path, capsys, tiny_models, *extra) -> tuple[Path, str]:
    """`train` GRPO on agent episodes of the calculator task rows, small; the run and what it printed."""
    from tests.helpers import run_cli

    config = tmp_path / "quick.toml"
    config.write_text(QUICK, encoding="utf-8")
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", "--no-sft", "--model", tiny_models["llama"], "--tasks",
                             task_file(tmp_path / "tasks.jsonl"), "--reward", "task_success", "--reward",
                             "call_format@0.2", "--algo", "grpo", "--out", run, "--config", config, *SMALL, *extra)
    assert code == 0, err
    return run, out


def test_train_grpo_on_episodes_from_the_cli_logs_the_agent_metrics(tmp_path, capsys, tiny_models):
    run, out = train_on_tasks(tmp_path, capsys, tiny_models)
    manifest, lines = trained_metrics(run)
    assert manifest["metrics"]["episodes"] is True and manifest["inputs"]["rl"]["max_tool_rounds"] == 2
    assert len(lines) == 2
    for line in lines:
        assert 0.0 <= line["episode/call_rate"] <= 1.0 and line["episode/success"] == 0.0
        assert line["episode/rounds"] <= 2
    assert "evaluation" not in out  # an agent is judged by evaluate-agent, not the single-completion report


def test_train_ppo_with_an_environment_class_from_the_cli(tmp_path, capsys, tiny_models, monkeypatch):
    from tests.helpers import run_cli

    config = tmp_path / "quick.toml"
    config.write_text(QUICK, encoding="utf-8")
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", "--no-sft", "--model", tiny_models["llama"], "--tasks",
                             task_file(tmp_path / "tasks.jsonl", start=3), "--environment",
                             "tests.rollouts.test_episodes:Counter", "--reward", "environment_reward", "--algo", "ppo",
                             "--out", run, "--config", config, *SMALL)
    assert code == 0, err
    manifest, lines = trained_metrics(run)
    assert manifest["metrics"]["episodes"] is True and manifest["inputs"]["rl"]["environment"].endswith(":Counter")
    assert manifest["metrics"]["heldout_reward_sft"] == 3.0  # no call reaches add: each episode keeps its reset 3
    assert all("episode/call_rate" in line and line["loss/value"] is not None for line in lines)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "token_mean"])
def test_the_runtimes_inserted_ids_get_no_gradient(tiny_models, tokenizer, loss_type):
    from slm_align.envelope.ratio import ratio_of
    from slm_align.rl.losses import aggregate, clipped_policy_loss, clipped_value_loss, kl_k3

    backend, episode = scripted_episode(tiny_models, tokenizer)
    input_ids, attention, width, mask = pack([episode], tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        logprobs, _, _ = forward_logprobs(backend.model, input_ids, attention, width, 1.0)
    new = logprobs.clone().requires_grad_()
    values = torch.zeros_like(mask, requires_grad=True)
    ratio = ratio_of(new, logprobs - 0.1, 20.0)
    advantages = torch.linspace(-1.0, 1.0, mask.shape[1]).unsqueeze(0)
    policy, _ = clipped_policy_loss(ratio, advantages, mask, (0.2, 0.28), loss_type, 96)
    kl = aggregate(kl_k3(new, logprobs + 0.3, 20.0), mask, loss_type, 96)
    value = clipped_value_loss(values, torch.zeros_like(mask), torch.ones_like(mask), mask, 0.2)
    grad_new, grad_values = torch.autograd.grad(policy + kl + value, [new, values])
    inserted = (mask == 0) & (attention[:, width:] == 1)
    assert inserted.any()
    assert torch.all(grad_new[inserted] == 0) and torch.all(grad_values[inserted] == 0)
    assert torch.all(grad_new[mask.bool()] != 0) and torch.all(grad_values[mask.bool()] != 0)


def test_calls_left_in_the_answer_count_in_the_call_rate():
    """With ``max_tool_rounds`` 0 the calls are the answer and nothing runs them: an episode whose
    answer holds a call counts as calling (the watchdog's tool-use collapse reads this count); one
    answering in prose does not. Counting only the calls the runtime ran read 0.0 here."""
    call = '<tool_call>{"name": "set_alarm", "arguments": {"time": "07:00"}}</tool_call>'
    called = Episode("p", [1, 2], 1, [True], call, [], 0, False, [], None, [0.0])
    prose = Episode("p", [1, 2], 1, [True], "Sure, at seven.", [], 0, False, [], None, [0.0])
    stats = episode_stats([called, prose, prose], TaskSet(["p"], [{}]))
    assert stats["episode/call_rate"] == pytest.approx(1 / 3)
    assert stats["episode/with_calls"] == 1.0
    assert stats["episode/calls"] == 0.0  # calls run (and validated) only
