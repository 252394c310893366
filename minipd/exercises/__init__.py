"""Exercise checkers and reference solutions, one module per chapter (``minipd.exercises.ch01``, ...).

Every checker takes the reader's function, prints PASS, FAIL (with where the answers part) or
TODO (the stub is untouched), and returns the :class:`~minipd.exercises.checking.CheckResult`.
"""

from minipd.exercises.checking import CheckResult, check_tensor_fn

__all__ = ["CheckResult", "check_tensor_fn"]
