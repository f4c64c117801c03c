"""Export, by job: ``converters/`` (merge, ONNX, genai, ExecuTorch, calibration), ``targets/`` (one
class per ``--target``, registered once), ``publishing/`` (``run_export``, verification, model
cards, adapter export), ``packaging/`` (bundles and updates for devices); the GGUF readers and
writers beside them."""
