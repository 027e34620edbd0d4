"""Hugging Face interop: config.json to spec (import-hf), checkpoints both ways (convert-hf, export-hf), family tables."""
