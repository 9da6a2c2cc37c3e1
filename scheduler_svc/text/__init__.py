"""Text handling for the scheduler: tokenizer, chat templates and streaming detokenization (no torch)."""

from scheduler_svc.text.detokenizer import DetokenizeResult, IncrementalDetokenizer
from scheduler_svc.text.tokenizer import Tokenizer

__all__ = ["DetokenizeResult", "IncrementalDetokenizer", "Tokenizer"]
