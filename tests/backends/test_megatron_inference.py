"""MegatronSampler's stand-down/wake state machine and results, against a fake megatron engine."""

from types import SimpleNamespace

import pytest
import torch

from backends.megatron.inference import MegatronSampler
from pipeline.messages import Completion
from pipeline.testing import FakeDynamicEngine


def _params(temperature, top_k, top_p, new_tokens, termination):
    return SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, new=new_tokens, end=termination)


def _sampler(reply=lambda prompt, params: ([1, 2], [-0.5, -0.25]), events=None):
    engine = FakeDynamicEngine(reply, events)
    sampler = MegatronSampler(
        engine, torch.nn.Linear(2, 2), params=_params, position_limit=None, cache_bytes=lambda: 4096
    )
    return sampler, engine


def _generate(sampler, prompts, **kwargs):
    arguments = {"max_new_tokens": 4, "temperature": 1.0} | kwargs
    return sampler.generate(prompts, **arguments)


def test_a_stood_down_engine_resumes_once_before_it_generates():
    events = []
    sampler, _ = _sampler(events=events)
    sampler.release()
    sampler.release()  # a second stand-down suspends nothing more
    assert sampler.cache_bytes() == 0
    _generate(sampler, [[3]])
    sampler.wake()  # already awake
    assert [e[0] for e in events] == ["suspend", "resume", "generate"]
    assert sampler.cache_bytes() == 4096


def test_wake_after_stand_down_resumes_and_a_running_engine_is_left_alone():
    events = []
    sampler, engine = _sampler(events=events)
    sampler.wake()
    sampler.release()
    sampler.wake()
    assert [e[0] for e in events] == ["suspend", "resume"]
    assert not engine.suspended


def test_a_completion_ends_at_its_first_stop_token_and_megatron_stops_on_the_first_stop_id():
    events = []
    sampler, _ = _sampler(lambda prompt, params: ([5, 9, 7, 3], [-1.0, -2.0, -3.0, -4.0]), events)
    out = _generate(sampler, [[1], [2]], stop_token_ids=(3, 9))
    assert out == [Completion(tokens=(5, 9), logprobs=(-1.0, -2.0), finish_reason="stop")] * 2
    assert events[0][2].end == 3 and events[0][2].new == 4
    assert _generate(sampler, [[1]])[0].finish_reason == "length"
    assert events[1][2].end == -1  # no stop ids: megatron never terminates early


def test_greedy_asks_megatron_for_top_1_at_temperature_1():
    events = []
    sampler, _ = _sampler(events=events)
    _generate(sampler, [[1]], temperature=0.0)
    params = events[0][2]
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 1, 0.0)


def test_top_p_below_one_is_refused_away_from_temperature_one():
    sampler, _ = _sampler()
    with pytest.raises(NotImplementedError, match="top_p < 1 needs temperature 1"):
        _generate(sampler, [[1]], temperature=0.7, top_p=0.9)
    assert _generate(sampler, [[1]], temperature=1.0, top_p=0.9)[0].tokens == (1, 2)


def test_a_result_without_a_logprob_per_token_is_a_loud_error():
    sampler, _ = _sampler(lambda prompt, params: ([1, 2], [-0.5]))
    with pytest.raises(RuntimeError, match="1 logprobs for 2 tokens"):
        _generate(sampler, [[1]])
