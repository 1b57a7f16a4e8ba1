"""hqq's quantizer is imported at a quantized KV cache's first use, not wherever transformers is
(ficoco.deferred_imports): a model build pays no torch._dynamo import, and the quantized cache still quantizes
with the real hqq."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("hqq")

PROBE = """
import sys
import ficoco
import transformers.cache_utils as cache_utils
stand_in = type(sys.modules["hqq.core.quantize"]).__name__
print(stand_in, "torch._dynamo" in sys.modules)
import torch
quantizer = cache_utils.HQQQuantizer
q, meta = quantizer.quantize(torch.randn(4, 64), axis=1, device="cpu", compute_dtype=torch.float32, nbits=4,
                             group_size=64)
back = quantizer.dequantize(q, meta)
print(type(sys.modules["hqq.core.quantize"]).__name__, tuple(back.shape))
from hqq.core.quantize import HQQLinear
print(HQQLinear.__module__)
"""


def test_transformers_imports_without_hqq_and_the_cache_quantizes_with_it() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    first, after, linear = done.stdout.split("\n")[:3]
    assert first == "_DeferredModule False"  # transformers' import left hqq (and torch._dynamo) alone
    assert after == "module (4, 64)"  # the real module replaced the stand-in at the quantizer's first use
    assert linear == "hqq.core.quantize"


def test_a_process_that_imported_hqq_first_keeps_it() -> None:
    probe = ("import sys, hqq.core.quantize as real; import ficoco; from ficoco.deferred_imports import defer_hqq; "
             "print(defer_hqq(), sys.modules['hqq.core.quantize'] is real)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "True"]
