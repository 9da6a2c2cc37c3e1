"""The front end both client APIs (gRPC and OpenAI-compatible HTTP) share: tokenizing, chat, detokenizing, streams."""

from scheduler_svc.frontend.api import FrontEnd
from scheduler_svc.frontend.inputs import GenerateInput
from scheduler_svc.frontend.detokenizer import DetokenizeResult, IncrementalDetokenizer
from scheduler_svc.frontend.stream import RequestStream, StreamItem
from scheduler_svc.frontend.tokenizer import Tokenizer

__all__ = ["DetokenizeResult", "FrontEnd", "GenerateInput", "IncrementalDetokenizer", "RequestStream", "StreamItem",
           "Tokenizer"]
