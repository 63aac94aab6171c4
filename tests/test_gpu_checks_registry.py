"""Every GPU check of :mod:`benchmarks.gpu_checks` can be run by name (``--only``) and has its
pytest test (tests/gpu/test_gpu_checks.py): checked on the CPU, where a check left out of the
registry would otherwise go unnoticed until a device run asks for it."""

from benchmarks import gpu_checks
from tests.gpu.test_gpu_checks import NAMES


def test_every_check_function_is_registered_and_tested():
    functions = {name: fn for name, fn in vars(gpu_checks).items() if name.startswith("check_") and callable(fn)}
    unregistered = sorted(name for name, fn in functions.items() if fn not in gpu_checks.CHECKS.values())
    assert not unregistered, f"check functions missing from gpu_checks.CHECKS: {unregistered}"
    assert set(gpu_checks.CHECKS) == set(NAMES)
