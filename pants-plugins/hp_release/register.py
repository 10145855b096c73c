"""Each package's version has one source: ``__version__`` in its ``__init__.py``.

Every ``python_distribution`` under ``src/python/<pkg>/`` gets its ``version`` from
``src/python/<pkg>/__init__.py``, so a release bumps one line and the wheel, the runtime
``__version__`` and the first-party requirements of the packages above it all follow.
A BUILD file that still sets ``version=`` is rejected, so a second source cannot creep back.
"""

from __future__ import annotations

import os
import re

from pants.backend.python.util_rules.package_dists import SetupKwargs, SetupKwargsRequest
from pants.engine.fs import DigestContents, GlobMatchErrorBehavior, PathGlobs
from pants.engine.rules import Get, collect_rules, rule
from pants.engine.target import Target
from pants.engine.unions import UnionRule

_VERSION_LINE = re.compile(r'^__version__ = "([^"]+)"$', re.MULTILINE)


class VersionFromInitRequest(SetupKwargsRequest):
    @classmethod
    def is_applicable(cls, target: Target) -> bool:
        return target.address.spec_path.startswith("src/python/")


@rule
async def version_from_init(request: VersionFromInitRequest) -> SetupKwargs:
    address = request.target.address
    kwargs = request.explicit_kwargs
    if "version" in kwargs:
        raise ValueError(
            f"{address}: remove `version=` from python_artifact; the version is read from "
            f"{address.spec_path}/__init__.py (`__version__ = \"X.Y.Z\"`), its only source."
        )
    init_py = os.path.join(address.spec_path, "__init__.py")
    contents = await Get(
        DigestContents,
        PathGlobs(
            [init_py],
            glob_match_error_behavior=GlobMatchErrorBehavior.error,
            description_of_origin=f"the version of {address}",
        ),
    )
    found = _VERSION_LINE.findall(contents[0].content.decode())
    if len(found) != 1:
        raise ValueError(
            f"{address}: {init_py} must contain exactly one line `__version__ = \"X.Y.Z\"`, "
            f"found {len(found)}."
        )
    return SetupKwargs({**kwargs, "version": found[0]}, address=address)


def rules():
    return [*collect_rules(), UnionRule(SetupKwargsRequest, VersionFromInitRequest)]
