"""The embeddable agent: multi-turn chat on an exported model, tool calls,
and preference collection.

    agent = Agent.load("model-Q8_0.gguf", store="prefs.db", consent=True)
    reply = agent.chat("What is 17 * 23?")
    agent.feedback("up")

    agent = Agent.load("base-F16.gguf", adapters=["adapter-sft-F16.gguf"])   # a shipped round
    agent.set_adapters(["adapter-sft-F16.gguf", "adapter-dpo-F16.gguf"])    # the next, base kept
    agent = Agent.load("base-F16.gguf", adapters=[...], candidate=[...], store="prefs.db")   # an A/B test

No torch, no transformers: llama.cpp or onnxruntime does the arithmetic,
``tokenizers`` and ``jinja2`` the text.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

from slm_align.errors import UserError
from slm_align.ondevice.agent.ab_trial import Candidate, DeviceRouter
from slm_align.ondevice.agent.artifact_forms import resolve_artifact
from slm_align.ondevice.agent.backend import Backend
from slm_align.ondevice.agent.loading import load_model
from slm_align.ondevice.agent.logprobs import token_logprobs
from slm_align.ondevice.agent.prompt import PromptFitter, next_prompt, template_origin, turn_end
from slm_align.ondevice.agent.settings import (
    ChatSettings,
    Recording,
    SamplingParams,
    refuse_unknown,
    take_options,
)
from slm_align.ondevice.agent.store import PreferenceStore, new_token
from slm_align.ondevice.agent.tool_text import user_answer
from slm_align.ondevice.gguf.adapter_check import chain_digest
from slm_align.ondevice.templates.chat import require_tool_template
from slm_align.ondevice.tools.registry import ToolRegistry

CONVERSATION_FORMAT = 1
SEED_SPAN = 2 ** 32
"""Seeds both backends take: llama.cpp's are 32 bits."""
ALTERNATIVE_TEMPERATURE = 0.8
"""A second candidate to a greedy answer is sampled at this temperature (greedy
would repeat the first)."""


class Cancelled(Exception):
    """The caller gave up on the answer (a server's client disconnected): generation
    stopped, nothing recorded."""


@dataclass
class Reply:
    """One assistant answer: its text, the tool rounds that led to it, and its id
    in the preference store."""

    text: str
    tool_calls: list = field(default_factory=list)
    """Every call made on the way, as ``{name, arguments, ok, content}``."""
    turn_id: Optional[int] = None
    turn_token: Optional[str] = None
    """What feedback on the recorded turn must present (see :func:`record_feedback`)."""
    truncated: bool = False
    """The answer hit ``max_tokens`` before the model ended it."""
    tokens: int = 0
    """Tokens generated for the final answer."""
    prompt_tokens: int = 0
    """Tokens of the prompt the final answer was generated from."""
    logprobs: Optional[list] = None
    """With ``Agent(logprobs=N)``: each token of the final answer with its log-probability and the N
    likeliest tokens at its step (OpenAI's ``logprobs.content``)."""


def fold_seed(seed: int) -> int:
    """Any integer seed, folded into the 32 bits both backends take."""
    return seed % SEED_SPAN


def alternative_sampling(params: SamplingParams, seed: Optional[int] = None) -> SamplingParams:
    """How a second candidate for a "which is better" choice is sampled: with ``seed``, else the
    next one after the first answer's, and never greedily (that would repeat the first answer)."""
    chosen = replace(params, seed=fold_seed(params.seed + 1 if seed is None else seed))
    if chosen.temperature <= 0:
        chosen = replace(chosen, temperature=ALTERNATIVE_TEMPERATURE)
    return chosen


def opened(recording: Recording) -> Recording:
    """``recording`` with its store opened when it names a file."""
    if recording.store is None or hasattr(recording.store, "record_turn"):
        return recording
    return replace(recording, store=PreferenceStore(Path(recording.store)))


def record_feedback(store, turn_id: int, kind: str, text: Optional[str] = None, other: Optional[str] = None,
                    preferred: str = "this", *, token: str) -> int:
    """Write a verdict on a recorded turn: ``up``, ``down``, ``edit`` (with ``text``) or ``choice``
    (with ``other``, ``preferred`` naming the winner); returns the feedback row's id.

    ``token`` is the turn's token (``Reply.turn_token``, a server's ``x_turn_token``): without it
    nobody can write feedback on turns they were not given.
    """
    if store.turn_by_token(turn_id, token) is None:
        raise UserError(f"unknown turn id {turn_id} or wrong turn token; pass the turn_id and "
                        f"turn_token of an answer")
    if kind in ("up", "down"):
        return store.thumbs(turn_id, kind == "up")
    if kind == "edit" and text is not None:
        return store.edit(turn_id, text)
    if kind == "choice" and other is not None:
        return store.choose(turn_id, other, preferred)
    raise UserError(f"feedback '{kind}': use up, down, edit (with text) or choice (with other)")


class Agent:
    """A conversation with one exported model. Not thread-safe: one agent per
    conversation (servers queue)."""

    def __init__(self, backend: Backend, model_id: str, tools: Optional[ToolRegistry] = None,
                 settings: ChatSettings = ChatSettings(), recording: Recording = Recording(),
                 cancel: Optional[threading.Event] = None, **options: Any):
        """An agent on ``backend`` answering as ``model_id`` with ``tools``; ``settings``: how it
        converses, ``recording``: where its turns go. ``options``: any field of either by name,
        replacing the object's (``Agent(backend, model_id, sampling=..., store=...,
        consent=True)``); ``cancel``: an event another thread sets to stop generation."""
        settings = take_options(settings, options)
        recording = take_options(recording, options)
        refuse_unknown("Agent", options)
        if settings.answer_grammar and backend.kind != "gguf":
            raise UserError("constrained answers (a grammar) need a GGUF model: llama.cpp samples "
                            "under grammars, onnxruntime does not")
        self.backend = backend
        self.base_id = model_id
        """The sha256 of the artifact loaded (with adapters, the base's)."""
        self.tools = tools
        self.system = settings.system
        self.sampling = settings.sampling or SamplingParams()
        self.max_tool_rounds = settings.max_tool_rounds
        self.use_grammar = settings.grammar
        self.answer_grammar = settings.answer_grammar
        """See :attr:`ChatSettings.answer_grammar`."""
        self.logprobs = settings.logprobs
        """See :attr:`ChatSettings.logprobs`."""
        self.describe_tools = settings.describe_tools
        """See :attr:`ChatSettings.describe_tools`."""
        self.store = recording.store
        self.consent = recording.consent
        self.cancel = cancel
        """When set (by another thread), generation stops before its next token
        with :class:`Cancelled`."""
        self._stops: Optional[tuple] = None
        self.ab: Optional[DeviceRouter] = None
        """Routes each new conversation (``Agent.load(..., candidate=...)``)."""
        self.reset()

    @classmethod
    def load(cls, artifact: Union[str, Path], device: Optional[str] = None,
             threads: Optional[int] = None, n_ctx: Optional[int] = None,
             chat_template: Optional[str] = None, adapters: Sequence[Union[str, Path]] = (),
             candidate: Union[Candidate, Sequence[Union[str, Path]]] = (),
             **options: Any) -> "Agent":
        """Open a .gguf file or an ONNX export directory; ``device`` takes threads and context
        from its profile; ``chat_template`` ("chatml" or a Jinja file) replaces the model's own;
        ``adapters``: LoRA adapter GGUFs made for a GGUF base (see :func:`load_model`);
        ``candidate``: adapters A/B-tested against them, or a
        :class:`~slm_align.ondevice.agent.ab_trial.Candidate` with the trial's share, test and
        client, decided in the store (see :class:`~slm_align.ondevice.agent.ab_trial.DeviceRouter`).
        ``options`` go to :class:`Agent` (``tools``, ``settings``, ``recording``, or their fields by
        name); ``store`` may be a path, opened as a preference store."""
        model = load_model(artifact, device, threads, n_ctx, chat_template, adapters)
        recording = take_options(options.pop("recording", Recording()), options)
        agent = cls(model.backend, model.sha256, recording=opened(recording), **options)
        if not isinstance(candidate, Candidate):
            candidate = Candidate(tuple(candidate))
        if candidate.adapters:
            # the adapters given, else the artifact's: a manifest's, a bundle's, BASE+A's
            current = adapters or resolve_artifact(artifact).adapters
            agent.ab = DeviceRouter(agent, current, candidate)
            agent.reset()  # the first conversation, routed
        return agent

    @property
    def adapters(self) -> list[dict]:
        """The LoRA adapters applied to the base now, in order: ``{"file", "sha256"}`` each."""
        return list(getattr(self.backend, "adapters", ()))

    @property
    def model_id(self) -> str:
        """What answers, as preference records name it: the artifact's sha256, or with adapters the
        digest of the base and the adapters in order
        (:func:`~slm_align.ondevice.gguf.adapter_check.chain_digest`, what an adapter export's
        manifest records)."""
        return chain_digest(self.base_id, [adapter["sha256"] for adapter in self.adapters])

    def set_adapters(self, adapters: Sequence[Union[str, Path]]) -> list[dict]:
        """Swap the LoRA adapters on the base (GGUF; none: the base alone) without reloading it;
        later turns are recorded under the new :attr:`model_id`. The conversation stays."""
        if not hasattr(self.backend, "set_adapters"):
            raise UserError("adapters apply to a GGUF base in llama.cpp; this agent runs an ONNX export")
        return self.backend.set_adapters([Path(adapter) for adapter in adapters])

    # conversation state
    def reset(self) -> None:
        """Start a new conversation (the system prompt stays)."""
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.conversation_id = self.ab.begin(self) if self.ab else uuid.uuid4().hex
        self.last: Optional[Reply] = None
        self._last_prompt: list[dict] = []
        self.trace: list[tuple[str, list[int]]] = []
        """The ids of the last answer's turn, piece by piece (see :meth:`respond`)."""

    def save(self, path: Union[str, Path]) -> Path:
        """Write the conversation to a JSON file (restore it with :meth:`restore`)."""
        from slm_align.atomic import write_json_atomic

        return write_json_atomic(Path(path), {"format": CONVERSATION_FORMAT, "id": self.conversation_id,
                                              "model": self.model_id, "messages": self.messages})

    def restore(self, path: Union[str, Path]) -> None:
        """Continue a conversation saved by :meth:`save`."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            messages = data["messages"]
            assert data.get("format") == CONVERSATION_FORMAT and isinstance(messages, list)
        except (OSError, ValueError, KeyError, TypeError, AssertionError):
            raise UserError(f"{path} is not a conversation saved by Agent.save") from None
        self.messages = messages
        self.conversation_id = data.get("id", uuid.uuid4().hex)
        self.last = None
        if self.ab:
            self.ab.enter(self, self.conversation_id)

    # prompting
    def prompt_tokens(self, messages: list[dict], max_tokens: int) -> tuple[list[int], list[dict]]:
        """The prompt's ids, dropping the oldest turns (never the system prompt) until the reply
        fits; message contents are tokenised once each, as plain text (see
        :mod:`slm_align.ondevice.agent.prompt`)."""
        fitter = PromptFitter(self.backend, self.tools.specs() if self.tools else None, self.describe_tools)
        return fitter.fit(messages, max_tokens)

    def _generate(self, prompt: list[int], sampling: SamplingParams, grammar: Optional[str],
                  chat: bool = True, may_call: bool = False) -> Iterator[str]:
        """Text pieces of one completion, ended by EOS (in a chat also by the token the template
        ends an assistant's turn with), a stop string or ``max_tokens``. ``sampling.call_threshold``
        acts only on a reply that ``may_call`` a tool: a tool round, or a reply whose tools are offered with
        no round allowed (its calls stay in the text: a function row's answer). Not the answer after the
        last round: a call there runs nothing."""
        if not may_call:
            sampling = replace(sampling, call_threshold=None)
        stops = self.chat_stops() if chat else self.backend.eos_ids
        tokens: list[int] = []
        self._sampled = tokens
        """The ids the model sampled this round (its end-of-turn token included when it ended by
        one): what the next round's prompt carries on with."""
        emitted = ""
        holdback = max((len(s) for s in sampling.stop), default=1) - 1
        self._truncated = True
        self._usage = (len(prompt), 0)
        self._token_logprobs = [] if self.logprobs is not None else None
        self._check_cancel()
        for token in self.backend.generate(prompt, sampling, grammar):
            self._check_cancel()
            if token in stops:
                self._truncated = False
                self._sampled = tokens + [token]
                break
            tokens.append(token)
            self._record_logprobs(token)
            self._usage = (len(prompt), len(tokens))
            text = self.backend.detokenize(tokens)
            cut = min((text.find(s) for s in sampling.stop if s in text), default=-1)
            if cut >= 0:
                self._truncated = False
                text = text[:cut]
            if len(tokens) >= sampling.max_tokens or cut >= 0:
                if text[len(emitted):]:
                    yield text[len(emitted):]
                return
            ready = text[: len(text) - holdback] if holdback else text
            if len(ready) > len(emitted) and not ready.endswith("\ufffd"):
                yield ready[len(emitted):]
                emitted = ready
        text = self.backend.detokenize(tokens)
        if text[len(emitted):]:
            yield text[len(emitted):]

    def chat_stops(self) -> set[int]:
        """End-of-sequence ids and the template's end of the assistant's turn
        (:func:`~slm_align.ondevice.agent.prompt.turn_end`), worked out once per template."""
        template = self.backend.chat_template
        if self._stops is None or self._stops[0] != template:
            self._stops = (template, set(self.backend.eos_ids) | turn_end(self.backend))
        return self._stops[1]

    def _record_logprobs(self, token: int) -> None:
        if self._token_logprobs is not None:
            entry = token_logprobs(self.backend.last_logits(), token, self.logprobs, self.backend.detokenize)
            self._token_logprobs.append(entry)

    def _check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("the answer was cancelled")

    def _grammar(self) -> Optional[str]:
        if self.tools and len(self.tools) and self.use_grammar and self.backend.kind == "gguf":
            return self.tools.gbnf_grammar()
        return None

    # chatting
    def stream(self, message: str, **sampling) -> Iterator[str]:
        """Answer ``message`` piece by piece; tool rounds happen before the final answer streams."""
        return self.respond(self.messages + [{"role": "user", "content": message}], **sampling)

    def respond(self, messages: list[dict], **sampling) -> Iterator[str]:
        """Answer a whole conversation (as an OpenAI request sends it): the last message is the
        user's, or a tool result the caller sends back. The conversation becomes this agent's.

        The first prompt is rendered from the messages; after each tool round the model continues
        the ids it was fed and sampled, with the runtime's inserted ids after them
        (:func:`~slm_align.ondevice.agent.prompt.next_prompt`). ``trace`` records those pieces in
        order: ``("prompt", ids)``, then ``("sampled", ids)`` and ``("inserted", ids)`` per round,
        the final answer's ``("sampled", ids)`` last (a ``("prompt", ids)`` anew where the
        conversation outgrew the context and its oldest turns were cut)."""
        params = replace(self.sampling, **sampling)
        if self.tools:
            require_tool_template(self.backend.chat_template, template_origin(self.backend))
        self.messages = list(messages)
        start = len(self.messages)
        calls: list[dict] = []
        prompt, window = self.prompt_tokens(self.messages, params.max_tokens)
        self.trace = [("prompt", list(prompt))]
        for _ in range(self.max_tool_rounds if self.tools else 0):
            text = "".join(self._generate(prompt, params, self._grammar(), may_call=True))
            self.trace.append(("sampled", list(self._sampled)))
            parsed = self.tools.parse_calls(text)
            if not parsed.wants_tools:
                yield text
                self._finish(text, window + self.messages[start:], calls, params)
                return
            turn = self._act(text, parsed, calls)
            prompt = self._after_round(prompt, turn, params)
        if self.tools and self.max_tool_rounds:  # no round left: a call would run nothing, never shown as text
            text = "".join(self._generate(prompt, params, self.answer_grammar))  # the rule would force calls
            self.trace.append(("sampled", list(self._sampled)))
            text = user_answer(text, self.tools.parse_calls(text))
            yield text
            self._finish(text, window + self.messages[start:], calls, params)
            return
        pieces = []
        for piece in self._generate(prompt, params, self.answer_grammar, may_call=bool(self.tools)):
            pieces.append(piece)
            yield piece
        self.trace.append(("sampled", list(self._sampled)))
        self._finish("".join(pieces), window + self.messages[start:], calls, params)

    def _after_round(self, prompt: list[int], turn: int, params: SamplingParams) -> list[int]:
        """The next round's prompt: this round's, the sampled ids, and what the template renders
        after the assistant's turn ``turn`` (its closing, the tool results, the next opening);
        rendered anew, oldest turns cut, when that outgrows the context."""
        glue = self.messages[:turn] + [{"role": "assistant", "content": ""}] + self.messages[turn + 1:]
        inserted = PromptFitter(self.backend, self.tools.specs(), self.describe_tools).after(glue, turn)
        following = next_prompt(prompt, self._sampled, inserted)
        if len(following) + params.max_tokens <= self.backend.n_ctx:
            self.trace.append(("inserted", following[len(prompt) + len(self._sampled):]))
            return following
        following, _ = self.prompt_tokens(self.messages, params.max_tokens)
        self.trace.append(("prompt", list(following)))
        return following

    def complete(self, text: str, **sampling) -> Iterator[str]:
        """Continue ``text`` as plain text, piece by piece: no template, no tools (what a base model
        does); the conversation is untouched and nothing is recorded. ``self.last`` holds the
        :class:`Reply` once done."""
        params = replace(self.sampling, **sampling)
        prompt = self.backend.tokenize(text)
        if len(prompt) + params.max_tokens > self.backend.n_ctx:
            raise UserError(f"the text needs {len(prompt)} tokens plus {params.max_tokens} for the "
                            f"continuation, more than the context window of {self.backend.n_ctx}; "
                            f"send a shorter text")
        pieces = []
        for piece in self._generate(prompt, params, None, chat=False):
            pieces.append(piece)
            yield piece
        self.last = Reply("".join(pieces), truncated=self._truncated, tokens=self._usage[1],
                          prompt_tokens=self._usage[0], logprobs=self._token_logprobs)

    def chat(self, message: str, **sampling) -> Reply:
        """Answer ``message`` (calling tools as the model asks); the reply is
        recorded when a store is set."""
        for _ in self.stream(message, **sampling):
            pass
        return self.last

    def _act(self, text: str, parsed, calls: list) -> int:
        """Run the model's tool calls; results (and malformed calls) go back to it as
        observations. Returns the index of the assistant's turn in the conversation."""
        turn = len(self.messages)
        self.messages.append(call_turn(text, parsed))
        for call in parsed.calls:
            observation = self.tools.execute(call)
            calls.append({"name": call.name, "arguments": call.arguments, "ok": observation.ok,
                          "content": observation.content})
            self.messages.append(observation.as_message())
        for error in parsed.errors:
            calls.append({"name": error.name, "arguments": None, "ok": False, "content": error.content})
            self.messages.append(error.as_message())
        return turn

    def _finish(self, text: str, window: list[dict], calls: list, params: SamplingParams) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self._last_prompt = window
        turn_id = None
        token = None
        if self.store is not None:
            token = new_token()
            recorded = {**params.to_dict(), "chat_template": self.backend.chat_template_origin}
            if self.adapters:
                recorded["adapters"] = self.adapters
            if self.tools and len(self.tools):  # what the prompt offered: the next round trains on it
                recorded["tools"] = self.tools.specs()
            turn_id = self.store.record_turn(self.conversation_id, window, text, self.model_id, recorded,
                                             self.consent, token=token)
            if self.ab:
                self.ab.recorded(self, turn_id)
        self.last = Reply(text, calls, turn_id, token, truncated=self._truncated, prompt_tokens=self._usage[0],
                          tokens=self._usage[1], logprobs=self._token_logprobs)

    # feedback
    def _require_last(self) -> Reply:
        if self.last is None or self.last.turn_id is None:
            raise UserError("no recorded answer to give feedback on; chat first, with "
                            "a preference store set")
        return self.last

    def feedback(self, kind: str, text: Optional[str] = None, other: Optional[str] = None,
                 preferred: str = "this") -> None:
        """Feedback on the last answer: ``up``, ``down``, ``edit`` (with ``text``) or
        ``choice`` (with ``other``)."""
        last = self._require_last()
        record_feedback(self.store, last.turn_id, kind, text, other, preferred, token=last.turn_token)
        if self.ab:
            self.ab.evaluate()

    def alternative(self, messages: Optional[list[dict]] = None, seed: Optional[int] = None, **sampling) -> str:
        """A second candidate for the last answer (or for the prompt ``messages`` of a stored turn),
        sampled as :func:`alternative_sampling` says (``seed``, else the next seed), for a "which is
        better" choice."""
        if messages is None and not self._last_prompt:
            raise UserError("no answer to compare with yet; chat first")
        params = alternative_sampling(replace(self.sampling, **sampling), seed)
        prompt, _ = self.prompt_tokens(messages if messages is not None else self._last_prompt, params.max_tokens)
        return "".join(self._generate(prompt, params, None))


def call_turn(text: str, parsed) -> dict:
    """The assistant's turn that asked for tools, stored once, in OpenAI's form: its calls in
    ``tool_calls`` and the text around them in ``content``; a reply with a call that could not be
    read is kept as written (``content`` only). The prompt renders it the way the model's template
    expects (:func:`~slm_align.ondevice.templates.chat.template_form`)."""
    if parsed.errors or not parsed.calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": parsed.text, "tool_calls": [call.as_dict() for call in parsed.calls]}
