"""README.md in the Hugging Face model-card format for what ``merge`` and ``export`` publish.

The YAML header carries base_model (a hub id, when the base came from the hub or names one),
library_name, the license where the source states it, tags and the training data (a hub id, the demo
corpus, or a file's sha256). The body holds only what the run measured and recorded: the gate's
figures (headroom.json), the evaluation's deltas and intervals (eval/report.json), the envelope's
settings and guard counts (rl/manifest.json), the quantization and its verification (the export
manifests); then how to run it. A section whose record is missing is left out, never filled in.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from slm_align.config.from_sft import recorded_data_path
from slm_align.config.hub_ids import looks_like_hub_id
from slm_align.export.publishing.parity import perplexity_change
from slm_align.modeling.models import DEFAULT_MODEL_DIR
from slm_align.runs import MANIFEST, MODEL_CARD, RL_LAST, aligned_stages, policy_stage

CARD = MODEL_CARD
MARKER = "<!-- model card written by slm-align: merge and export rewrite this file -->"
BUNDLED_LICENSE = "apache-2.0"  # the bundled model is this project's own, under its license
_FRONT_MATTER = re.compile(r"\A---\s*\n(.*?)\n---\s*\n", re.DOTALL)


def _read_json(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


@dataclass
class RunRecords:
    """What a run recorded, each None when its stage did not run."""

    run: Path
    sft: Optional[dict]
    headroom: Optional[dict]
    rl: Optional[dict]
    evaluation: Optional[dict]
    preference: Optional[dict] = None
    """The DPO or KTO stage's manifest when that is the aligned stage the merge folds in."""
    last_rl: bool = False
    """The merge folds in the RL stage's last iteration (``rl-last``), not the adapter the stage published."""


def read_run(run: Path, stage: Optional[str] = None) -> RunRecords:
    """The manifests and reports of ``run``; of its aligned stages, only the one a merge
    folds in: ``stage`` (``sft``: none; ``rl-last``: the RL stage's, whose evaluation report, of the published
    adapter, is left out), else the latest."""
    stages = aligned_stages(run)
    latest = stages[-1] if stages else None
    if stage is not None:
        latest = policy_stage(stage) if policy_stage(stage) in stages else None
    last_rl = stage == RL_LAST
    rl = _read_json(run / "rl" / MANIFEST) if latest == "rl" else None
    preference = _read_json(run / latest / MANIFEST) if latest in ("dpo", "kto") else None
    evaluation = None if last_rl else _read_json(run / "eval" / "report.json")
    return RunRecords(run=run, sft=_read_json(run / "sft" / MANIFEST),
                      headroom=_read_json(run / "headroom.json"), rl=rl,
                      evaluation=evaluation, preference=preference, last_rl=last_rl)


def run_of(path: Optional[Path]) -> Optional[Path]:
    """The run behind ``path``: the run itself, or the run a merged directory was made
    from; None for neither."""
    if path is None:
        return None
    if (path / "sft" / MANIFEST).is_file():
        return path
    manifest = _read_json(path / MANIFEST)
    if manifest is None or manifest.get("stage") != "merge":
        return None
    run = Path(manifest["inputs"]["sft_adapter"]).parent.parent
    return run if (run / "sft" / MANIFEST).is_file() else None


def _front_matter(readme: Path) -> dict:
    """The YAML header of a model directory's own README.md (empty when it has none)."""
    if not readme.is_file():
        return {}
    match = _FRONT_MATTER.match(readme.read_text(encoding="utf-8", errors="replace"))
    if match is None:
        return {}
    import yaml

    try:
        header = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return {}
    return header if isinstance(header, dict) else {}


def _directory_base(path: Path) -> dict[str, Optional[str]]:
    """A local base model: its hub id (config's _name_or_path, when it names one)
    and its card's license."""
    config = _read_json(path / "config.json") or {}
    name = config.get("_name_or_path") or ""
    header = _front_matter(path / CARD)
    hub_id = name if name and not Path(name).exists() and looks_like_hub_id(name) else None
    return {"name": hub_id or path.name, "hub_id": hub_id, "license": header.get("license")}


def base_model(model: dict) -> dict[str, Optional[str]]:
    """The base model as a card names it: a display name, a hub id when known,
    a license when stated."""
    kind = model["kind"]
    ref = model["ref"]
    if kind == "hub":
        return {"name": ref, "hub_id": ref, "license": None}
    if kind == "bundled" or kind == "dir" and Path(ref) == DEFAULT_MODEL_DIR:
        return {"name": "slm-align's bundled 2.5M Llama",
                "hub_id": None, "license": BUNDLED_LICENSE}
    if kind == "dir":
        return _directory_base(Path(ref))
    return {"name": Path(ref).name, "hub_id": None, "license": None}


def dataset_entry(inputs: dict) -> str:
    """The training data by name (a hub id, the demo stories) or by the sha256 of its bytes."""
    recorded = inputs["data"]
    if recorded.startswith("hub:"):
        return recorded_data_path(inputs)
    if recorded.startswith("demo:"):
        return "slm-align demo stories"
    return f"sha256:{recorded}"


def _yaml_list(name: str, values: list[str]) -> list[str]:
    return [f"{name}:"] + [f"- {json.dumps(value)}" for value in values]


def front_matter(records: Optional[RunRecords], library: str, tags: list[str]) -> list[str]:
    """The YAML header lines, ``---`` to ``---``."""
    lines = ["---"]
    if records is not None and records.sft is not None:
        base = base_model(records.sft["inputs"]["model"])
        if base["hub_id"]:
            lines.append(f"base_model: {json.dumps(base['hub_id'])}")
        if base["license"]:
            lines.append(f"license: {json.dumps(base['license'])}")
        lines.extend(_yaml_list("datasets", [dataset_entry(records.sft["inputs"])]))
    lines.append(f"library_name: {library}")
    lines.append("pipeline_tag: text-generation")
    lines.extend(_yaml_list("tags", tags))
    lines.append("---")
    return lines


def _algo(records: Optional[RunRecords]) -> Optional[str]:
    if records is None:
        return None
    for stage in (records.rl, records.preference):
        if stage is not None:
            return stage["metrics"]["algo"]
    return None


def card_tags(records: Optional[RunRecords], extra: list[str]) -> list[str]:
    """slm-align, the stages the model went through, then ``extra`` (the
    artifact's format and types)."""
    tags = ["slm-align"]
    if records is not None and records.sft is not None:
        tags.extend(["lora", "sft"])
    algo = _algo(records)
    if algo is not None:
        tags.append(algo)
    return tags + extra


def _data_line(inputs: dict) -> str:
    entry = dataset_entry(inputs)
    path = recorded_data_path(inputs)
    if entry.startswith("sha256:"):
        return f"- Data: `{Path(path).name}` ({entry})"
    return f"- Data: {entry}"


def _sft_line(sft: dict) -> str:
    settings = sft["inputs"]["sft"]
    metrics = sft["metrics"]
    lora = settings["lora"]
    return (f"- SFT: {metrics['steps']} steps of LoRA (r={lora['r']}, alpha={lora['alpha']:g}), "
            f"NEFTune alpha {settings['neftune_alpha']}, learning rate "
            f"{settings['learning_rate']:g} on {metrics['train_documents']} documents; train loss "
            f"{metrics['train_loss']:.3f}, eval loss {metrics['eval_loss']:.3f} on "
            f"{metrics['eval_documents']} held-out documents")


def _rl_line(rl: dict, last: bool = False) -> str:
    """The RL stage's line: its held-out reward after RL is the published adapter's, or with ``last`` the last
    iteration's (measured when it is not the one published)."""
    metrics = rl["metrics"]
    after, policy = metrics["heldout_reward_rl"], "RL"
    kept = (metrics.get("watchdog") or {}).get("last")
    if last and kept is not None:
        policy = f"RL's last iteration, {kept['step']}"
        if kept["heldout_reward"] is not None:
            after = kept["heldout_reward"]
    return (f"- RL: {metrics['algo'].upper()}, {metrics['steps']} iterations, learning rate "
            f"{metrics['learning_rate']:g}; held-out reward {metrics['heldout_reward_sft']:.3f} "
            f"(SFT) -> {after:.3f} ({policy}) over "
            f"{metrics['eval_prompts']} prompts")


def _preference_line(stage: dict) -> str:
    metrics = stage["metrics"]
    line = (f"- {metrics['algo'].upper()}: {metrics['steps']} steps on {metrics['train_items']} "
            f"preference items, learning rate {metrics['learning_rate']:g}")
    headline = metrics.get("heldout_accuracy")
    if headline is not None:
        kind = headline["kind"].replace("_", " ")
        line += (f"; held-out {kind} {metrics['heldout_before'][headline['kind']]:.3f} -> "
                 f"{headline['value']:.3f} (95% CI {_interval(headline['ci95'], 3)}) on "
                 f"{metrics['heldout_pairs']} pairs")
    return line


def training_section(records: RunRecords) -> list[str]:
    """Base, data and what each training stage did and measured."""
    if records.sft is None:
        return []
    lines = ["## Training",
             "", f"- Base model: {base_model(records.sft['inputs']['model'])['name']}",
             _data_line(records.sft["inputs"]), _sft_line(records.sft)]
    if records.rl is not None:
        lines.append(_rl_line(records.rl, records.last_rl))
    if records.preference is not None:
        lines.append(_preference_line(records.preference))
    return lines + [""]


def gate_section(records: RunRecords) -> list[str]:
    """The headroom gate's figures against their thresholds, and its verdict (with
    --force when it was used)."""
    gate = records.headroom
    if gate is None:
        return []
    lines = ["## Headroom gate", "", "| figure | value | threshold | result |", "|---|---|---|---|"]
    for figure in gate["figures"]:
        result = "pass" if figure["passed"] else "FAIL"
        lines.append(f"| {figure['name']} | {figure['value']:.3f} | {figure['comparison']} "
                     f"{figure['threshold']:g} | {result} |")
    verdict = f"Verdict: **{gate['verdict']}**"
    if records.rl is not None and records.rl["metrics"]["gate"]["forced"]:
        verdict += " (RL trained anyway with --force)"
    recommendation = gate["info"].get("recommendation")
    if recommendation:
        verdict += f"; advice: {recommendation['why']}"
    return lines + ["", verdict + ".", ""]


def _interval(bounds: list[float], digits: int) -> str:
    return f"[{bounds[0]:.{digits}f}, {bounds[1]:.{digits}f}]"


def evaluation_section(records: RunRecords) -> list[str]:
    """The evaluation report's comparisons: reward delta and win rate with their 95% intervals."""
    report = records.evaluation
    if report is None or not report["comparisons"]:
        return []
    lines = ["## Evaluation", "",
             f"{report['prompts']} held-out prompts, temperature {report['temperature']:g}, up to "
             f"{report['max_new_tokens']} new tokens; reward: "
             f"{', '.join(report['reward_terms'])}.", "",
             "| policy | baseline | reward delta (95% CI) | win rate (95% "
             "CI) | p-value | verdict |",
             "|---|---|---|---|---|---|"]
    for row in report["comparisons"]:
        lines.append(f"| {row['policy']} | {row['baseline']} | {row['delta']:+.3f} "
                     f"{_interval(row['delta_ci95'], 3)} | {row['win_rate']:.3f} "
                     f"{_interval(row['win_rate_ci95'], 3)} | "
                     f"{row['p_value']:.4f} | {row['verdict']} |")
    return lines + [""]


def envelope_section(records: RunRecords) -> list[str]:
    """The safety envelope's settings, how often each guard acted, and what
    the watchdog published."""
    if records.rl is None:
        return []
    metrics = records.rl["metrics"]
    settings = ", ".join(f"{name} {value}" for name, value in metrics["envelope"].items())
    guards = ", ".join(f"{name} {count}" for name, count in metrics["guard"].items())
    lines = ["## Safety envelope", "", f"- Settings: {settings}", f"- Guard counts: {guards}"]
    watchdog = metrics.get("watchdog")
    if watchdog and watchdog["enabled"]:
        line = (f"- Collapse watchdog: {watchdog['events']} events, {watchdog['recoveries']} "
                f"recoveries; published the adapter of iteration {watchdog['published_step']}")
        if records.last_rl:
            line += "; this model holds the last iteration's adapter (rl/adapter-last) instead"
        lines.append(line)
    elif watchdog:
        lines.append("- Collapse watchdog: off (the last adapter published)")
    return lines + [""]


def _verification(verification: dict) -> str:
    if verification.get("skipped"):
        return "not verified (--no-verify)"
    parts = [f"tokenizer {'identical' if verification['tokenizer_match'] else 'DIFFERENT'}",
             f"top-1 agreement {verification['agreement']:.3f} over "
             f"{verification['agreement_positions']} tokens (min "
             f"{verification['min_agreement']:g})"]
    perplexity = perplexity_change(verification)
    if perplexity:
        parts.append(f"held-out {perplexity}")
    if verification["prompts"]:
        parts.append(f"greedy identical on "
                     f"{verification['greedy_exact']}/{verification['prompts']} prompts")
    parts.append("passed" if verification["passed"] else "FAILED")
    return "; ".join(parts)


def quantization_section(artifacts: list[tuple[str, dict]]) -> list[str]:
    """One row per artifact: type, size, sha256 and its verification against the PyTorch model."""
    if not artifacts:
        return []
    lines = ["## Files and quantization",
             "", "| file | type | size | sha256 | verification against PyTorch |",
             "|---|---|---|---|---|"]
    for name, metrics in artifacts:
        forced = " (published with --force)" if metrics.get("forced") else ""
        lines.append(f"| `{name}` | {metrics['quant']} | {metrics['bytes'] / 1e6:.1f} MB | "
                     f"`{metrics['sha256'][:16]}` | "
                     f"{_verification(metrics['verification'])}{forced} |")
    return lines + [""]


def merged_usage(name: str) -> list[str]:
    """How to run a merged directory: transformers, then export for the devices."""
    return ["## How to run", "", "```python", "from transformers import "
                                              "AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{name}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")', "```", "", "```bash",
            f"slm-align export {name} --target gguf   # llama.cpp / Ollama, parity-checked",
            f"slm-align export {name} --target onnx   # onnxruntime", "```", ""]


def gguf_usage(names: list[str]) -> list[str]:
    """How to run a GGUF: llama.cpp, slm-align's runtime (chat, serve), Ollama."""
    name = names[0]
    modelfile = Path(name).with_suffix(".Modelfile").name
    return ["## How to run", "", "```bash", f"llama-cli -m {name} -cnv             # llama.cpp",
            f"slm-align chat {name}                 # slm-align's runtime, with feedback",
            f"slm-align serve {name}                # OpenAI-compatible HTTP server",
            f"ollama create my-model -f {modelfile} && ollama run my-model", "```", ""]


def onnx_usage(name: str) -> list[str]:
    """How to run an ONNX export: slm-align's runtime (chat, serve)."""
    return ["## How to run",
            "", "```bash", f"slm-align chat {name}    # onnxruntime, slm-align's runtime",
            f"slm-align serve {name}   # OpenAI-compatible HTTP server", "```", ""]


def compose(title: str, records: Optional[RunRecords], library: str, tags: list[str],
            artifacts: list[tuple[str, dict]], usage: list[str]) -> str:
    """The whole card: header, title, the run's measured sections, the artifacts, how to run it."""
    lines = front_matter(records, library, card_tags(records, tags)) + [MARKER, "", "# "
                                                                                    f"{title}", ""]
    lines.append("Aligned with slm-align; every figure below was measured by this run and "
                 "read from its records.")
    lines.append("")
    if records is not None:
        for section in (training_section, gate_section, evaluation_section, envelope_section):
            lines.extend(section(records))
    lines.extend(quantization_section(artifacts))
    lines.extend(usage)
    return "\n".join(lines)


def card_blocked(directory: Path) -> Optional[str]:
    """Why no card may be written in ``directory``: a README.md there that slm-align
    did not write; else None."""
    path = directory / CARD
    if path.is_file() and MARKER not in path.read_text(encoding="utf-8", errors="replace"):
        return f"kept {path}: slm-align did not write it, so no model card was written over it"
    return None


def merged_card(run: Path, name: str, stage: Optional[str] = None) -> str:
    """The card of a run's merged directory (of ``stage``: ``sft`` or an aligned stage; None: the
    latest)."""
    return compose(name, read_run(run, stage), "transformers", ["safetensors"], [],
                   merged_usage(name))


def _records(source: Optional[Path]) -> Optional[RunRecords]:
    """The records of the run behind ``source``; of a merged directory's run, those of the stage it
    folds in."""
    run = run_of(source)
    if run is None:
        return None
    merged = _read_json(source / MANIFEST) if source != run else None
    if merged is None:
        return read_run(run)
    return read_run(run, merged["inputs"].get("aligned_stage") or "sft")


def gguf_card(out: Path, source: Optional[Path], published: tuple[str, dict]) -> str:
    """The card of an export directory's GGUF files: ``published`` (name, metrics) and every other
    ``model-*.gguf`` already there, each from its manifest."""
    artifacts = {published[0]: published[1]}
    for manifest in sorted(out.glob("model-*.gguf.json")):
        name = manifest.name[: -len(".json")]
        if name not in artifacts and (out / name).is_file():
            artifacts[name] = json.loads(manifest.read_text(encoding="utf-8"))["metrics"]
    rows = sorted(artifacts.items())
    records = _records(source)
    title = out.name if records is None else records.run.name
    quants = [metrics["quant"] for _, metrics in rows]
    return compose(title, records, "gguf", ["gguf"] + quants, rows,
                   gguf_usage([name for name, _ in rows]))


def genai_usage(name: str) -> list[str]:
    """How to run a genai folder: onnxruntime-genai's API (the mobile bindings make the
    same calls), our runtime."""
    return ["## How to run", "", "```python", "import onnxruntime_genai as og", "",
            f'model = og.Model("{name}")  # genai_config.json holds the search defaults',
            "tokenizer = og.Tokenizer(model)", "params = og.GeneratorParams(model)",
            "generator = og.Generator(model, params)",
            'generator.append_tokens(tokenizer.encode("Once upon a time"))',
            "while not generator.is_done():",
            "    generator.generate_next_token()", "```", "", "```bash",
            f"slm-align chat {name}    # slm-align's runtime (onnxruntime)", "```", ""]


def executorch_usage(name: str) -> list[str]:
    """How to run a .pte folder: ExecuTorch's Python runtime (the Android/iOS runtimes
    load the same program)."""
    return ["## How to run",
            "", "```python", "import torch", "from executorch.runtime import Runtime", "",
            f'forward = Runtime.get().load_program("{name}/model.pte").load_method("forward")',
            "# one token and its position per call; the static KV cache lives in the program",
            "logits = forward.execute([torch.tensor([[token_id]]), "
            "torch.tensor([position])])[0]  # (1, 1, vocab)",
            "```", ""]


def onnx_card(name: str, metrics: dict, source: Optional[Path]) -> str:
    """The card inside an ONNX export directory, genai folder or ExecuTorch folder."""
    records = _records(source)
    title = name if records is None else records.run.name
    if metrics.get("target") == "executorch":
        tags = ["executorch", "xnnpack", metrics["quant"]]
        return compose(title, records, "executorch", tags, [(name, metrics)],
                       executorch_usage(name))
    if metrics.get("target") == "genai":
        tags = ["onnx", "onnxruntime-genai", metrics["quant"]]
        return compose(title, records, "onnx", tags, [(name, metrics)], genai_usage(name))
    return compose(title, records, "onnx", ["onnx", metrics["quant"]], [(name, metrics)],
                   onnx_usage(name))
