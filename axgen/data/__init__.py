"""Data tools: readers of text, JSON Lines and Parquet inputs, tokenizers, chat templates, and `axgen data`'s datasets."""
