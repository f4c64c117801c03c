"""The SFT stage (stage.py): LoRA with NEFTune on transformers' Trainer."""
