"""Environments for tests/test_environment.py, importable as 'tests.environment_fixtures:Class' (data.environment)."""

from __future__ import annotations

import time


class Calculator:
    """Word problems with an add tool; ends when the model answers without a call."""

    calls = 0

    def reset(self, prompt, answer, **columns):
        self.answer, self.calls = answer, 0
        return prompt

    def add(self, a: int, b: int) -> int:
        """Add two whole numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.calls += 1
        return a + b

    def divide(self, a: float, b: float) -> float:
        """Divide a by b.

        Args:
            a: The dividend.
            b: The divisor.
        """
        return a / b  # raises ZeroDivisionError for b = 0: the episode ends with it as the observation

    def wait(self, seconds: float) -> str:
        """Wait, then say so.

        Args:
            seconds: How long to wait.
        """
        time.sleep(seconds)
        return "waited"

    def reward(self) -> float:
        return 0.5 * min(self.calls, 1)


class CheckAgain:
    """Free text, no tools: every answer gets 'Check again.' until the third turn's answer."""

    def reset(self, prompt, answer, **columns):
        self.turns = 0
        return [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": prompt}]

    def step(self, text: str):
        self.turns += 1
        return "Check again." if self.turns < 3 else None


class Untyped:
    def reset(self, prompt, **row):
        return prompt

    def add(self, a, b):
        """Add.

        Args:
            a: one
            b: two
        """
        return a + b


class Picky:
    """reset refuses rows whose prompt has a '+' (every arith row)."""

    def reset(self, prompt, **row):
        if "+" in prompt:
            raise ValueError(f"cannot read {prompt!r}")
        return prompt

    def step(self, text: str):
        return None
