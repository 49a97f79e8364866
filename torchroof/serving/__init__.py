"""Serving: what an inference engine's steps cost when each step mixes requests.

A serving engine (vLLM, SGLang, TensorRT-LLM) runs continuous batching: every step
processes, for each running request, a prefill chunk, a whole prompt or one decode token,
each against its own cached context. :class:`StepTimer` prices such a step from a model
prepared once (:func:`torchroof.prepare`): the linear layers, norms and collectives on the
step's total token count, attention per sequence over its own cache, the output projection
on the rows that sample a token.
"""

from torchroof.serving.composition import SequenceWork, decodes, prompt
from torchroof.serving.disaggregated import simulate_disaggregated
from torchroof.serving.disaggregated_result import DisaggregatedResult
from torchroof.serving.rate_search import RateSearch, search_rate
from torchroof.serving.requests import Request
from torchroof.serving.results import ServeResult
from torchroof.serving.scheduler import EngineConfig
from torchroof.serving.serve import highest_rate, serve
from torchroof.serving.simulate import simulate
from torchroof.serving.speculative import Speculative
from torchroof.serving.step_time import StepTime, StepTimer

__all__ = [
    "DisaggregatedResult",
    "EngineConfig",
    "RateSearch",
    "Request",
    "SequenceWork",
    "ServeResult",
    "Speculative",
    "StepTime",
    "StepTimer",
    "decodes",
    "highest_rate",
    "prompt",
    "search_rate",
    "serve",
    "simulate",
    "simulate_disaggregated",
]
