"""The README of a device bundle: which runtime loads the artifact on a phone,
and the calls to make."""

from __future__ import annotations

RUNTIMES = {
    "gguf": {
        "name": "llama.cpp",
        "packages": "Android: llama.cpp's `examples/llama.android` (JNI over libllama); iOS/macOS: "
                    "llama.cpp's `llama.xcframework` (Swift package); desktop/boards: libllama, "
                    "llama-cpp-python or `llama-cli`.",
        "calls": [
            "`llama_model_load_from_file(\"model/{name}\", llama_model_default_params())`",
            "`llama_init_from_model(model, ctx_params)` (threads and context from the device)",
            "`llama_chat_apply_template(...)` with the template embedded in the GGUF (also in "
                  "chat_template.jinja)",
            "`llama_tokenize(vocab, prompt, ...)` (the tokenizer is embedded in the GGUF)",
            "`llama_sampler_chain_init` + `llama_sampler_init_top_k/top_p/min_p/temp/dist` from "
            "sampling.json (`llama_sampler_init_greedy` for temperature 0)",
            "loop: `llama_decode(ctx, batch)`, `llama_sampler_sample(sampler, ctx, -1)`, "
            "`llama_token_to_piece`, stop at `llama_vocab_is_eog`",
        ],
    },
    "onnx": {
        "name": "onnxruntime",
        "packages": "Android: `com.microsoft.onnxruntime:onnxruntime-android`; iOS: the "
                    "`onnxruntime-objc` / `onnxruntime-c` pods (model.ort, when exported with "
                    "--ort-format, for reduced builds).",
        "calls": [
            "`OrtSession(env, \"model/{name}/model.onnx\", options)` (intra-op "
            "threads from the device)",
            "tokenize with tokenizer.json (onnxruntime-extensions or a Hugging Face tokenizers "
            "binding) after rendering chat_template.jinja",
            "`session.run` with `input_ids`, `attention_mask`, `position_ids` and the "
            "`past_key_values.*` of the previous step; read `logits` and `present.*`",
            "sample the last position's logits with sampling.json (the app's own loop)",
        ],
    },
    "genai": {
        "name": "onnxruntime-genai",
        "packages": "Android: `com.microsoft.onnxruntime:onnxruntime-genai-android`; iOS: the "
                    "`onnxruntime-genai-objc` pod; also C, C# and Python APIs.",
        "calls": [
            "`Model(\"model/{name}\")` (reads genai_config.json: the search "
            "defaults are sampling.json's)",
            "`Tokenizer(model)`, `tokenizer.apply_chat_template(messages)`, "
            "`tokenizer.encode(prompt)` (when verification.json says `genai_adds_bos: false`, "
            "genai leaves the model's BOS out: put its id first unless the ids "
            "already start with it)",
            "`GeneratorParams(model)`, `params.set_search_options(max_length=..., "
            "temperature=..., top_p=...)`",
            "`Generator(model, params)`, `generator.append_tokens(tokens)`",
            "loop: `generator.generate_next_token()`, `generator.get_next_tokens()`, "
            "`TokenizerStream.decode`, until `generator.is_done()`",
        ],
    },
    "executorch": {
        "name": "ExecuTorch",
        "packages": "Android: `org.pytorch:executorch-android` (the `Module` class); iOS/macOS: "
                    "the ExecuTorch Swift package (`executorch` with `backend_xnnpack`: the "
                    "program delegates to XNNPACK). fp32 only.",
        "calls": [
            "`Module(\"model/{name}/model.pte\")` (`Module.load(path)` on Android); its "
            "`get_max_seq_len` method gives the static KV cache's length, `get_eos_ids` "
            "the end-of-sequence ids",
            "render chat_template.jinja and tokenize with tokenizer.json (ExecuTorch's "
            "`pytorch_tokenizers` or a Hugging Face tokenizers binding)",
            "for each prompt token: `forward(input_ids=[[token]] int64, cache_position=[position] "
            "int64)` -> logits (1, 1, vocab); the KV cache lives inside the program, "
            "position counts from 0",
            "loop: sample the last logits with sampling.json, feed the token at the next position, "
            "stop at an EOS id or at get_max_seq_len",
        ],
    },
}

VERDICTS = {True: "passed", False: "FAILED (published with --force)", None: "skipped"}


def _calls(target: str, artifact: str) -> str:
    name = artifact.split("/", 1)[1]
    return "\n".join(f"{index}. {call.replace('{name}', name)}"
                     for index, call in enumerate(RUNTIMES[target]["calls"], start=1))


def bundle_readme(described: dict) -> str:
    """The app developer's README for a bundle described by ``described`` (bundle.json's fields)."""
    target = described["target"]
    runtime = RUNTIMES[target]
    device = described["device"] or "any device"
    passed = VERDICTS[described["verification_passed"]]
    return f"""# Device bundle: {described['artifact']} ({described['quant']}) for {device}

Runtime: **{runtime['name']}**. {runtime['packages']}

## Files

- `{described['artifact']}`: the model ({target}, {described['quant']})
- `tokenizer.json`: the tokenizer ({described['tokenizer']})
- `chat_template.jinja`: the chat template (Jinja, Hugging Face conventions; absent for a base model)
- `sampling.json`: sampling defaults (temperature 0 is greedy)
- `tools.json`: tool schemas (OpenAI function format) of the default tools, for the template's `tools`
- `export-manifest.json`, `verification.json`: how the artifact was made and how it matched PyTorch ({passed})
- `bundle.json`: this list with every file's sha256, and `model_id`

## Calls to make

{_calls(target, described['artifact'])}

## Feedback

Record each answer and the user's verdicts in the preference store (SQLite) as docs/feedback-store.md of slm-align
specifies, with `model_id` = `{described['model_id']}` (bundle.json). Then, on a machine with slm-align:
`slm-align feedback export app.db --out prefs.jsonl` and `slm-align train --algo dpo --preferences prefs.jsonl`.
"""


def _adapter_calls(described: dict) -> str:
    """The llama.cpp calls that load the base, then apply the adapters in order, then run as a plain
    GGUF."""
    paths = ", ".join(f'"{entry["path"]}"' for entry in described["adapters"])
    scales = ", ".join(str(entry["scale"]) for entry in described["adapters"])
    count = len(described["adapters"])
    calls = [
        f'`llama_model_load_from_file("{described["base"]}", llama_model_default_params())`',
        f"`llama_adapter_lora_init(model, path)` for each of {paths}, in this order (the handles "
        "live as long as the model)",
        RUNTIMES["gguf"]["calls"][1],
        f"`llama_set_adapters_lora(ctx, adapters, {count}, scales)` with all {count} handles at "
        f"once, in the order above, scales {{{scales}}} (llama-cpp-python 0.3.36's "
        "`llama_set_adapter_lora(ctx, adapter, scale)` is a deprecated wrapper that sets that ONE "
        "adapter in place of the others)",
        *RUNTIMES["gguf"]["calls"][2:],
    ]
    return "\n".join(f"{index}. {call}" for index, call in enumerate(calls, start=1))


def _adapter_lines(described: dict) -> str:
    """One line per adapter, in load order; an update says which it ships and which the device
    has."""
    lines = []
    for entry in described["adapters"]:
        where = ""
        if "shipped" in entry:
            where = ", shipped in this update" if entry["shipped"] else ", already in the installed bundle"
        lines.append(f"- `{entry['path']}`: the {entry['stage']} adapter (scale {entry['scale']}, "
                     f"sha256 {entry['sha256'][:12]}{where})")
    return "\n".join(lines)


def _slm_align_calls(described: dict) -> str:
    """How slm-align's own runtime loads the base with the adapters."""
    adapters = ", ".join(f'"{entry["path"]}"' for entry in described["adapters"])
    flags = " ".join(f"--adapter {entry['path']}" for entry in described["adapters"])
    return (f'In Python: `Agent.load("{described["base"]}", adapters=[{adapters}])` '
            f"(`slm_align.ondevice.agent.runtime`); a shell: `slm-align chat {described['base']} {flags}`. "
            "An adapter made for another base is refused in one line before llama.cpp reads it.")


def _feedback(model_id: str) -> str:
    """The README's feedback section: the id to record answers under."""
    return f"""## Feedback

Record each answer and the user's verdicts in the preference store (SQLite) as docs/feedback-store.md of slm-align
specifies, with `model_id` = `{model_id}`
(bundle.json: the id of the base with these adapters applied in this order). Then, on a machine with slm-align:
`slm-align feedback export app.db --out prefs.jsonl` and `slm-align train --algo dpo --preferences prefs.jsonl`.
"""


def _base_type(described: dict) -> str:
    """``GGUF, Q4_1``: the base's own weight type, read from its file (never the adapters' export
    type); ``GGUF`` alone for a bundle.json written before it was recorded."""
    base_quant = described.get("base_quant")
    return f"GGUF, {base_quant}" if base_quant else "GGUF"


def adapter_bundle_readme(described: dict) -> str:
    """The README of a full base + adapters bundle described by ``described`` (bundle.json's
    fields)."""
    device = described["device"] or "any device"
    passed = VERDICTS[described["verification_passed"]]
    return f"""# Device bundle: {described['base']} + {len(described['adapters'])} LoRA adapter(s) for {device}

Runtime: **llama.cpp**. {RUNTIMES['gguf']['packages']}

## Files

- `{described['base']}`: the base model ({_base_type(described)}, \
sha256 {described['base_sha256'][:12]})
{_adapter_lines(described)}
- `tokenizer.json`: the tokenizer ({described['tokenizer']})
- `chat_template.jinja`: the chat template (Jinja, Hugging Face conventions; absent for a base model)
- `sampling.json`: sampling defaults (temperature 0 is greedy)
- `tools.json`: tool schemas (OpenAI function format) of the default tools, for the template's `tools`
- `export-manifest.json`, `verification.json`: how the adapters were made and how base + adapters matched PyTorch \
({passed})
- `bundle.json`: this list with every file's sha256, and `model_id`

Each adapter records the sha256 of the base it was made for: it applies to that base only, and only in this order.

## Calls to make

{_adapter_calls(described)}

## With slm-align

{_slm_align_calls(described)}

{_feedback(described['model_id'])}"""


def update_bundle_readme(described: dict) -> str:
    """The README of an update bundle: the adapters it ships and how to install them."""
    base = described["base"]
    return f"""# Update bundle: model_id {described['model_id'][:12]} replaces {described['replaces_model_id'][:12]}

This update ships only the adapters the installed bundle lacks, not the base. It applies to an installed
base + adapters bundle whose `bundle.json` has `base_sha256` = `{described['requires_base_sha256']}`
(`{base}`); on any other base, install a full bundle instead.

## Adapters, in load order

{_adapter_lines(described)}

## Install

1. Check the installed bundle's `base_sha256` against this bundle.json's `requires_base_sha256`; refuse the
   update otherwise.
2. Copy `adapters/*` beside the installed bundle's adapters (its `adapters/` folder) and check each file's sha256
   against this `bundle.json`.
3. Load the base and the adapters in the order above (the calls are those of the installed bundle's README,
   with this list), and replace the installed `bundle.json`, `export-manifest.json` and `verification.json`
   with these. With slm-align:
   `slm_align.export.packaging.adapter_bundle.apply_update(INSTALLED, UPDATE, OUT)` writes the full bundle
   the two make, each sha256 checked.

## With slm-align

{_slm_align_calls(described)}

{_feedback(described['model_id'])}"""
