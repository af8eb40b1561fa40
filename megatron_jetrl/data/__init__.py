"""Prompt sets (jsonl / parquet, chat templates), tokenizers, and what a run trains and evaluates on."""
