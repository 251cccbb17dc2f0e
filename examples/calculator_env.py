"""A calculator for word problems with numbers too large to add in one's head (examples/smollm2-tools.yaml).

One instance per episode. `reset` gives the model one worked example — a question, the tool call that answers it,
the tool's result and the reply — then the row's question: SmolLM2-135M-Instruct's chat template has no tool format,
so Ballast writes the tool's schema into the system message the way Qwen2.5's template does (trainer/environment.py),
and the example shows the model what such a call looks like. `calculate` is the tool; `reward` pays 0.1 for a call
that worked, beside numeric_answer's 1 for the right final number.
"""

from __future__ import annotations

import ast
import operator

EXAMPLE = [
    {"role": "user", "content": "Ava has 3127 stamps and buys 4518 more. How many stamps does Ava have now?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "calculate", "arguments": {"expression": "3127 + 4518"}}\n</tool_call>',
    },
    {"role": "tool", "name": "calculate", "content": "7645"},
    {"role": "assistant", "content": "Ava has 7645 stamps."},
]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


class Calculator:
    def reset(self, prompt: str, answer: str, **columns) -> list[dict]:
        self.worked = 0
        return [
            {"role": "system", "content": "You are a helpful assistant who solves math problems with a calculator."},
            *EXAMPLE,
            {"role": "user", "content": prompt},
        ]

    def calculate(self, expression: str) -> int:
        """Work out an arithmetic expression of whole numbers with +, - and *.

        Args:
            expression: The expression, e.g. "3127 + 4518 - 20".
        """
        value = _evaluate(ast.parse(expression, mode="eval").body)
        self.worked += 1
        return value

    def reward(self) -> float:
        return 0.1 if self.worked else 0.0


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError(f"{ast.unparse(node)!r} is not whole numbers with +, - and *")
