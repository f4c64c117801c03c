"""Every GGUF reader and writer: metadata fields, the tokenizer, adapter/base checks, the cached
dequantized load (readers); the HF -> GGUF converter, its architectures and vocabulary, and the
LoRA adapter writer (writers, which load transformers/safetensors inside their functions)."""
