"""Structured output on the scheduler: specs compiled to llguidance grammars, one matcher per sample, step bitmasks."""

from scheduler_svc.structured.compiler import GrammarCompiler, grammar_text
from scheduler_svc.core.result_check import token_allowed
from scheduler_svc.structured.matcher import Constraint, Grammar, fill_bitmasks

__all__ = ["Constraint", "Grammar", "GrammarCompiler", "fill_bitmasks", "grammar_text", "token_allowed"]
