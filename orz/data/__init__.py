"""Prompt data: datasets, templates, tokenizers, synthetic tasks and resumable sampling."""
