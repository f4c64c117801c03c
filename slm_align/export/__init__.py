"""Export: merged checkpoints, GGUF and ONNX artifacts."""
