"""The `math` reward: is the completion's final answer equal to the reference, by `math-verify`.

The completion's answer is what `math_verify.parse` extracts (a `\\boxed{...}` first, else the
last LaTeX or plain expression); the reference is parsed as if boxed. Numeric and symbolic
equivalence count (`0.5` = `\\frac{1}{2}`). A GSM8K-style reference ("...reasoning... #### 72")
is reduced to what follows its last `####`. Needs the `math` extra (math-verify).

math-verify bounds each parse and comparison with `signal.alarm`, which works only in the main
thread; rewards run in worker threads, so its timeouts are off and `reward.reward_s` bounds
the work instead.
"""

from __future__ import annotations

import logging
from typing import Any

from pipeline.contracts.errors import RecipeError
from pipeline.contracts.messages import Prompt

_verify: Any = None


def _math_verify() -> Any:
    global _verify
    if _verify is None:
        try:
            import math_verify
        except ImportError:
            raise RecipeError(
                "reward.function: 'math' needs the math-verify package: pip install 'grpo-pipeline[math]'"
            ) from None
        # It warns once that its timeouts are off; that is deliberate here (see the docstring).
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        _verify = math_verify
    return _verify


def reference_answer(answer: str) -> str:
    return answer.rpartition("####")[2].strip() if "####" in answer else answer.strip()


def math_reward(prompt: Prompt, completion: str) -> dict[str, float]:
    """1.0 when the completion's final answer equals `prompt.answer`; `has_answer` is logged
    beside (whether any answer could be extracted at all)."""
    mv = _math_verify()
    gold = mv.parse(f"\\boxed{{{reference_answer(prompt.answer)}}}", parsing_timeout=None)
    predicted = mv.parse(completion, parsing_timeout=None)
    correct = bool(gold and predicted) and mv.verify(gold, predicted, timeout_seconds=None)
    return {"reward": float(correct), "has_answer": float(bool(predicted))}
