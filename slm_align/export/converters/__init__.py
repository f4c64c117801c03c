"""Export converters: a merged checkpoint, ONNX, onnxruntime-genai and ExecuTorch writers,
calibration."""
