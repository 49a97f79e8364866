"""Serving: what an inference engine's steps cost when each step mixes requests.

A serving engine (vLLM, SGLang, TensorRT-LLM) runs continuous batching: every step
processes, for each running request, a prefill chunk, a whole prompt or one decode token,
each against its own cached context. :class:`StepTimer` prices such a step from a model
prepared once (:func:`torchroof.prepare`): the linear layers, norms and collectives on the
step's total token count, attention per sequence over its own cache, the output projection
on the rows that sample a token.
"""

from torchroof.serving.composition import SequenceWork, decodes, prompt
from torchroof.serving.load_curve import Knee, LoadCurve, find_knee
from torchroof.serving.rate_search import RateSearch, search_rate
from torchroof.serving.requests import Request
from torchroof.serving.results import ServeResult
from torchroof.serving.scheduler import EngineConfig
from torchroof.serving.serve import highest_rate, serve, serve_rates
from torchroof.serving.simulate import simulate
from torchroof.serving.step_time import StepTime, StepTimer

__all__ = [
    "EngineConfig",
    "Knee",
    "LoadCurve",
    "RateSearch",
    "Request",
    "SequenceWork",
    "ServeResult",
    "StepTime",
    "StepTimer",
    "decodes",
    "find_knee",
    "highest_rate",
    "prompt",
    "search_rate",
    "serve",
    "serve_rates",
    "simulate",
]
