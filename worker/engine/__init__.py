"""Continuous-batching inference engine: packed steps, paged KV cache, per-request sampling."""

from .config import EngineConfig
from .engine import InvalidRequestError, LLMEngine, RequestStream
from .outputs import EngineStats, Event, RequestFinished, TokenDelta, TokenLogprob
from .sampling_params import InvalidParamsError, SamplingParams
from .sequence import SERVICE_CLASSES

__all__ = ["EngineConfig", "EngineStats", "Event", "InvalidParamsError", "InvalidRequestError", "LLMEngine",
           "RequestFinished", "RequestStream", "SERVICE_CLASSES", "SamplingParams", "TokenDelta", "TokenLogprob"]
