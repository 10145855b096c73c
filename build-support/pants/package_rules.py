# BUILD-file prelude: the dependency rules every first-party package states in its BUILD file.
#
# A package may import its own files, the first-party packages named as its edges and third-party
# requirements.  A framework (torch, mindspore) is imported only inside the package's own
# platform/torch/ and platform/mindspore/ folders; the rest of the package is framework-neutral and
# may not reach into any package's framework folders either.  `entry` is the one neutral file that
# names the package's torch folder as a Pants dependency (the folder is imported by name at run
# time, which Pants cannot infer).

_FRAMEWORKS = ("!//3rdparty/python/*#torch", "!//3rdparty/python/*#mindspore")
_FOREIGN_PLATFORMS = ("!//src/python/*/platform/torch/**", "!//src/python/*/platform/mindspore/**")


def package_rules(*edges, entry="/platform/__init__.py"):
    own = ("/**",) + tuple(edges)
    third_party = ("//3rdparty/python/**", "!*")
    return (
        ({"path": entry}, "!/platform/mindspore/**", "/platform/torch/**")
        + _FOREIGN_PLATFORMS + own + _FRAMEWORKS + third_party,
        ({"path": "/platform/torch/**"}, "!/platform/mindspore/**", "!//3rdparty/python/*#mindspore")
        + own + third_party,
        ({"path": "/platform/mindspore/**"}, "!/platform/torch/**", "!//3rdparty/python/*#torch") + own + third_party,
        ("*", "!/platform/torch/**", "!/platform/mindspore/**") + _FOREIGN_PLATFORMS + own + _FRAMEWORKS + third_party,
    )
