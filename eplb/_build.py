"""The build step that ships eplb's kernels compiled (``[tool.setuptools.cmdclass]`` in pyproject.toml).

setuptools loads this file on its own (not as part of the package), so it imports nothing of eplb.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    """setuptools' ``build_py``, then :func:`eplb.precompile.ship` on the built package, in a fresh
    interpreter with an empty cache folder, into ``<build>/eplb/_precompiled``.

    Skipped for an editable install (a checkout changes, so it compiles on first use) and when
    ``EPLB_PRECOMPILE=0``. A failed compile only warns: the package then compiles on first use.
    """

    def run(self):
        super().run()
        build_lib = os.path.abspath(self.build_lib)
        target = os.path.join(build_lib, "eplb", "_precompiled")
        shutil.rmtree(target, ignore_errors=True)  # an earlier build's kernels, maybe of other sources
        if getattr(self, "editable_mode", False) or os.environ.get("EPLB_PRECOMPILE", "1") == "0":
            return
        with tempfile.TemporaryDirectory() as cache:
            path = [build_lib] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            env = {**os.environ, "EPLB_CACHE_DIR": cache, "PYTHONPATH": os.pathsep.join(path)}
            print("eplb: compiling the kernels to ship (about a minute; EPLB_PRECOMPILE=0 skips)", flush=True)
            done = subprocess.run([sys.executable, "-c", f"from eplb.precompile import ship; print(ship({target!r}))"],
                                  env=env, cwd=build_lib)
        if done.returncode != 0:
            self.warn("eplb: compiling the kernels failed; the package will compile them on first use")
