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
