"""Importing torchao (and what imports it) without its start-up noise.

On a machine without torchao's CUDA extensions (any CPU machine, or a GPU it has no kernels for),
``import torchao`` logs a warning per extension library it cannot load and torch logs a
deprecation per Enum it registers; diffusers' torchao quantizer logs that it cannot import
tensor classes a newer torchao moved. Lines a user reads as errors, about kernels and checkpoint
formats their run never uses. Diffusers, peft and transformers import torchao on their own when
it is installed, so :func:`import_torchao_quietly` imports it (and diffusers' quantizer) first
with those loggers held below ERROR for the import alone: later imports find the modules loaded,
and anything said after the import is shown as usual.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

_NOISY_AT_IMPORT = ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao")


@contextmanager
def _import_noise_held() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _NOISY_AT_IMPORT]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def import_torchao(name: str) -> ModuleType:
    """``importlib.import_module(name)`` (a torchao module) with its import-time warnings held back."""
    with _import_noise_held():
        return importlib.import_module(name)


def import_torchao_quietly() -> None:
    """Import torchao and diffusers' torchao quantizer now, quietly, where torchao is installed."""
    if importlib.util.find_spec("torchao") is None:
        return
    with _import_noise_held():
        importlib.import_module("torchao")
        importlib.import_module("diffusers.quantizers.torchao.torchao_quantizer")
