"""Thin entry: metadata lives in pyproject.toml. What setup.py adds: the start-up hook that lets a stock
DeepSpeed script switch to megatron_sp_ext by its JSON block alone (docs/deepspeed.md): the module
``megatron_sp_ext_autoload`` and the file ``megatron_sp_ext_autoload.pth`` at the top of site-packages.
The .pth file only imports that standard-library-only module, which does nothing until deepspeed is imported
(``MEGATRON_SP_EXT_DEEPSPEED_HOOK=0`` turns it off). Editable installs (``pip install -e .``, as ``make`` does)
get both too."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "megatron_sp_ext_autoload.pth"


class BuildPyWithPth(build_py):
    """build_py that also puts the .pth file at the top of the wheel (site-packages)."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH),
                       os.path.join(self._pth_dir(), PTH), preserve_mode=0)

    def _pth_dir(self) -> str:
        """Where the .pth goes: the top of the wheel. An editable install (pip install -e, setuptools >= 64) runs
        build_py with ``editable_mode`` and packs only its link files and what lands in install_lib (the unpacked
        editable wheel), not build_lib: the .pth goes there, so that editable installs get the hook too."""
        if getattr(self, "editable_mode", False):
            return self.get_finalized_command("install").install_lib
        return self.build_lib

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(py_modules=["megatron_sp_ext_autoload"], cmdclass={"build_py": BuildPyWithPth})
