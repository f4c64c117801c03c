"""Publishing commands: merge the adapters into the base weights, export to GGUF or ONNX."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from slm_align.cli.options import (
    ALLOW_PICKLE,
    DEVICE,
    OUT_NAMES,
    THREADS,
    ChatTemplateOpt,
    ConfigOpt,
    JsonFlag,
    ThreadsOpt,
    recipe_flags,
    recipe_from,
    use_threads,
)
from slm_align.cli.render import emit, print_export, print_merge

commands = typer.Typer()


@commands.command(epilog="Examples:\n\n  slm-align merge --run runs/demo                 # writes "
                         "runs/demo/merged/\n\n  slm-align merge --run runs/demo --out "
                         "models/story-rl --overwrite --json\n\n  slm-align merge --run runs/demo "
                         "--set model.allow_pickle=true   # a .bin base")
@recipe_flags([DEVICE, THREADS, ALLOW_PICKLE])
def merge(
    run: Path = typer.Option(..., "--run", "-r", help="Run directory with a finished SFT "
                                                      "stage (RL used if present)."),
    out: Optional[Path] = typer.Option(None, *OUT_NAMES, help="Output directory (default: RUN/merged, "
                                       "or RUN/merged-STAGE with --stage)."),
    stage: Optional[str] = typer.Option(None, "--stage", help="The run's policy to fold in: sft, rl, dpo, "
                                        "kto or rl-last (RL's last iteration where the watchdog published an "
                                        "earlier one; default: the latest finished stage)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    config: Optional[Path] = ConfigOpt,
    settings: Optional[dict[str, Any]] = None,
    as_json: bool = JsonFlag,
) -> None:
    """Fold the SFT and RL adapters into the base weights: a plain HF directory
    that loads without peft."""
    from slm_align.export.converters.merge import merge_run

    summary = merge_run(recipe_from(config, settings), run, out, overwrite, stage=stage).summary()
    emit(as_json, summary, lambda: print_merge(summary))


@commands.command(epilog="Examples:\n\n  slm-align export runs/demo --target gguf               # "
                         "Q8_0, parity-checked\n\n  slm-align export runs/demo --target gguf "
                         "--quant Q4_K_M\n\n  slm-align export runs/demo --target onnx --device "
                         "rpi5  # w8, arm64 preset\n\n  slm-align export runs/demo --target genai "
                         "--quant int4  # onnxruntime-genai folder\n\n  slm-align export runs/demo "
                         "--target executorch  # ExecuTorch model.pte (fp32, XNNPACK)\n\n  "
                         "slm-align export runs/demo --target gguf-adapter  # the round's LoRA "
                         "for llama.cpp, beside its base\n\n  "
                         "slm-align export runs/demo --stage sft  # the SFT policy, into "
                         "runs/demo/export-sft/ beside the RL one\n\n  "
                         "slm-align export ./SmolLM2-135M --target onnx --quant fp32 --out "
                         "exports/ --json\n\n  slm-align export runs/demo --system 'You tell short "
                         "stories.'  # the Modelfile's SYSTEM\n\n  slm-align export "
                         "gemma-3-270m.gguf --chat-template chatml   # a base model, a template "
                         "written in\n\nExit code 1 when verification fails (nothing "
                         "published unless --force).")
def export(
    source: str = typer.Argument(..., help="Run directory, merged/HF model "
                                           "directory, .gguf file or hub id."),
    target: str = typer.Option("gguf", "--target", "-t", help="gguf (llama.cpp), gguf-adapter (a "
                               "run's LoRA adapters as llama.cpp adapter GGUFs, bound by hash to "
                               "the base: the run's own .gguf, else base-F16.gguf), onnx "
                               "(onnxruntime), genai (an onnxruntime-genai folder: Android/iOS "
                               "bindings; Llama, Qwen2/3, Gemma 3) or executorch (an fp32 "
                               "model.pte, XNNPACK, static KV cache; not Gemma 3)."),
    quant: Optional[str] = typer.Option(None, "--quant", "-q", help="GGUF: F32, F16, Q8_0 (ours) "
                                        "or Q4_0, Q4_K_M, Q5_K_M, Q6_K, ... (llama.cpp's "
                                        "quantizer); default: the device's, else Q8_0 (gguf-adapter: "
                                        "the base's type, F16). ONNX/genai: "
                                        "w8 (8-bit weight-only, the default), int4 (4-bit body), "
                                        "int8 (dynamic), fp32. ExecuTorch: fp32 only."),
    device: Optional[str] = typer.Option(None, "--device", help="Device profile (see `slm-align devices list`)."),
    out: Optional[Path] = typer.Option(None, *OUT_NAMES, help="Output directory (default "
                                       "RUN/export, RUN/export-STAGE with --stage, or ./export)."),
    stage: Optional[str] = typer.Option(None, "--stage", help="A run's policy to export: sft (the "
                                        "prior), rl, dpo, kto or rl-last (RL's last iteration where the "
                                        "watchdog published an earlier one; default: the latest finished stage)."),
    preset: Optional[str] = typer.Option(None, help="ONNX int8 preset: arm64, "
                                                    "avx2, avx512, avx512_vnni."),
    ort_format: bool = typer.Option(False, "--ort-format", help="ONNX: also write model.ort for mobile builds."),
    min_agreement: float = typer.Option(0.9, help="Lowest top-1 agreement with "
                                                  "PyTorch for low-bit types."),
    threads: Optional[int] = ThreadsOpt,
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip the parity check "
                                                              "(recorded in the manifest)."),
    force: bool = typer.Option(False, "--force", help="Publish even when verification fails (recorded)."),
    calibrate: bool = typer.Option(False, "--calibrate", "--imatrix", help="GGUF Q4_K_M, IQ4_XS, ... from a run: "
                                   "llama.cpp's importance matrix from the run's held-out texts "
                                   "weighs the rounding."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing "
                                                              "artifact of the same name."),
    system: Optional[str] = typer.Option(None, "--system", help="GGUF: system prompt of the Ollama "
                                         "Modelfile written beside the artifact."),
    torch_device: str = typer.Option("auto", "--torch-device", help="Where the PyTorch side of the "
                                     "parity check runs: auto, cpu, cuda, cuda:N or mps (--device "
                                     "names the target profile)."),
    chat_template: Optional[str] = ChatTemplateOpt,
    as_json: bool = JsonFlag,
) -> None:
    """Merge and export to GGUF, ONNX, an onnxruntime-genai folder or an ExecuTorch program,
    quantized for a device, verified against the PyTorch model; beside a GGUF an Ollama Modelfile
    (`ollama create NAME -f model-Q8_0.Modelfile`)."""
    from slm_align.export.publishing.stage import ExportRequest, run_export

    use_threads(threads)  # PyTorch's side (conversion, parity); llama.cpp's from the request
    request = ExportRequest(source, target=target, quant=quant, device=device, out=out, verify=not no_verify,
                            overwrite=overwrite, force=force, min_agreement=min_agreement, ort_format=ort_format,
                            threads=threads, preset=preset, system=system, torch_device=torch_device,
                            chat_template=chat_template, calibrate=calibrate, stage=stage)
    summary = run_export(request).summary()
    emit(as_json, summary, lambda: print_export(summary))
