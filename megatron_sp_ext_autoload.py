"""Loaded at interpreter start by ``megatron_sp_ext_autoload.pth`` (installed with the package, wheel or editable).

Standard library only and cheap: it imports nothing else. It arranges that when ``deepspeed`` is
imported, ``megatron_sp_ext.deepspeed.hook.activate()`` runs, so a stock DeepSpeed script switches
to megatron_sp_ext's attention by its JSON block alone (``"sequence_parallel_ext": {...}``); a
config without the block is handed to DeepSpeed untouched. ``MEGATRON_SP_EXT_DEEPSPEED_HOOK=0``
turns the switch off. Never the block silently ignored: where the switch is off (that variable) or
could not be installed (its import failed), ``deepspeed.initialize`` refuses a config that holds the
block, naming it and why (``guard``); configs without it still go to DeepSpeed untouched. A failure here
never stops the interpreter.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys

ENV = "MEGATRON_SP_EXT_DEEPSPEED_HOOK"
SECTION_KEY = "sequence_parallel_ext"  # megatron_sp_ext.deepspeed.hook.SECTION_KEY (this module imports no package)


def has_section(args, kwargs: dict) -> bool:
    """Whether the config ``deepspeed.initialize(*args, **kwargs)`` will use (``config=``, ``config_params=`` or
    ``args.deepspeed_config``; dict or JSON path) holds ``sequence_parallel_ext``. An unreadable path: False
    (DeepSpeed reports it). The stdlib twin of hook._config_of (tests check they agree)."""
    config = kwargs.get("config")
    if config is None:
        config = kwargs.get("config_params")
    ns = args[0] if args else kwargs.get("args")
    if config is None and getattr(ns, "deepspeed_config", None) is not None:
        config = ns.deepspeed_config
    if config is not None and not hasattr(config, "items"):
        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, TypeError, ValueError):
            return False
    return config is not None and SECTION_KEY in config


def _user_error(message: str) -> Exception:
    try:
        from megatron_sp_ext.errors import SPConfigError  # noqa: PLC0415 - the package's user-error type
        return SPConfigError(message)
    except Exception:  # noqa: BLE001 - the package may be what failed to import
        return ValueError(message)


def guard(reason: str) -> None:
    """Wrap ``deepspeed.initialize`` so that a config holding the block is refused (``reason``: why the switch is
    not active); idempotent, and a no-op where the switch itself is installed."""
    import deepspeed  # noqa: PLC0415
    original = deepspeed.initialize
    if getattr(original, "_megatron_sp_ext", False):
        return

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        if has_section(args, kwargs):
            raise _user_error(f"{SECTION_KEY} is in the DeepSpeed config but megatron_sp_ext's JSON switch is not "
                              f"active ({reason}), so the block would be ignored: remove the block for "
                              f"DeepSpeed's own attention, or turn the switch on")
        return original(*args, **kwargs)

    initialize._megatron_sp_ext = "guard"
    initialize.__wrapped__ = original
    deepspeed.initialize = initialize


def _activate() -> None:
    if os.environ.get(ENV, "1") == "0":
        guard(f"{ENV}=0 turns it off")
        return
    try:
        from megatron_sp_ext.deepspeed.hook import activate  # noqa: PLC0415
        activate()
    except Exception as e:  # noqa: BLE001 - a broken hook must not break deepspeed
        sys.stderr.write(f"megatron_sp_ext: DeepSpeed JSON switch not installed ({type(e).__name__}: {e})\n")
        try:
            guard(f"its import failed: {type(e).__name__}: {e}")
        except Exception:  # noqa: BLE001
            pass


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
    if "deepspeed" in sys.modules:
        _activate()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
