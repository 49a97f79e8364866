"""Serving: what an inference engine's steps cost when each step mixes requests.

A serving engine (vLLM, SGLang, TensorRT-LLM) runs continuous batching: every step
processes, for each running request, a prefill chunk, a whole prompt or one decode token,
each against its own cached context. :class:`StepTimer` prices such a step from a model
prepared once (:func:`torchroof.prepare`): the linear layers, norms and collectives on the
step's total token count, attention per sequence over its own cache, the output projection
on the rows that sample a token.

:func:`serve` simulates a stream of requests through such steps, :func:`highest_rate` finds
the highest rate within latency targets, :func:`serve_rates` serves the same requests at a
list of rates; :func:`serving_figures`, :func:`serving_plot`, :func:`rate_plot` and
:func:`serving_html` draw what they give.
"""

from torchroof.serving.composition import SequenceWork, decodes, prompt
from torchroof.serving.disaggregated import simulate_disaggregated
from torchroof.serving.disaggregated_result import DisaggregatedResult
from torchroof.serving.load_curve import Knee, LoadCurve, find_knee
from torchroof.serving.plots import rate_figure, rate_plot, serving_figures, serving_plot
from torchroof.serving.rate_search import RateSearch, search_rate
from torchroof.serving.report import serving_html
from torchroof.serving.requests import Request
from torchroof.serving.results import ServeResult
from torchroof.serving.scheduler import EngineConfig
from torchroof.serving.serve import highest_rate, serve, serve_rates
from torchroof.serving.simulate import simulate
from torchroof.serving.speculative import Speculative
from torchroof.serving.step_time import StepTime, StepTimer

__all__ = [
    "DisaggregatedResult",
    "EngineConfig",
    "Knee",
    "LoadCurve",
    "RateSearch",
    "Request",
    "SequenceWork",
    "ServeResult",
    "Speculative",
    "StepTime",
    "StepTimer",
    "decodes",
    "find_knee",
    "highest_rate",
    "prompt",
    "rate_figure",
    "rate_plot",
    "search_rate",
    "serve",
    "serve_rates",
    "serving_figures",
    "serving_html",
    "serving_plot",
    "simulate",
    "simulate_disaggregated",
]
