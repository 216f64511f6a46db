"""Loaded at interpreter start by ``megatron_sp_ext_autoload.pth`` (installed with the package).

Standard library only and cheap: it imports nothing else. It arranges that when ``deepspeed`` is
imported, ``megatron_sp_ext.deepspeed.hook.activate()`` runs, so a stock DeepSpeed script switches
to megatron_sp_ext's attention by its JSON block alone (``"sequence_parallel_ext": {...}``); a
config without the block is handed to DeepSpeed untouched. ``MEGATRON_SP_EXT_DEEPSPEED_HOOK=0``
turns it off. Any failure here is reported once and never stops the interpreter.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

ENV = "MEGATRON_SP_EXT_DEEPSPEED_HOOK"


def _activate() -> None:
    try:
        from megatron_sp_ext.deepspeed.hook import activate  # noqa: PLC0415
        activate()
    except Exception as e:  # noqa: BLE001 - a broken hook must not break deepspeed
        sys.stderr.write(f"megatron_sp_ext: DeepSpeed JSON switch not installed ({type(e).__name__}: {e})\n")


class _Loader(importlib.abc.Loader):
    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def __getattr__(self, name):  # get_resource_reader, is_package, ... of the real loader
        return getattr(self.inner, name)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _activate()


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of the top-level ``deepspeed`` package; removes itself once used."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if os.environ.get(ENV, "1") == "0":
        return
    if "deepspeed" in sys.modules:
        _activate()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
