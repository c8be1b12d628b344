"""The library's words in the command line's: the library names `accel.prepare`'s keywords in its
messages (`tp=2`, `shard='fsdp'`, `devices=4`); the command line shows its own flags for them
(`--tp 2`, `--shard fsdp`, `--nproc_per_node 4`).

>>> as_flags("tp=2 and shard='fsdp' cannot be combined; devices=8 exceeds 4")
'--tp 2 and --shard fsdp cannot be combined; --nproc_per_node 8 exceeds 4'
>>> as_flags("kernel_opt=True on xla needs fp32 weights; tp_head= splits the head")
'--kernel-opt on xla needs fp32 weights; --tp_head splits the head'
"""

from __future__ import annotations

import re

from accel.cli.config import LIBRARY_FLAGS

# prepare's keyword (a field of the library's config) -> the command line's flag for it: read
# from LIBRARY_FLAGS, the one table of the two spellings (the EMA decay, which the command line
# builds from --model_ema*, named by its switch).
KEYWORD_FLAGS = {
    **{
        flag.field.rsplit(".", 1)[-1]: flag.flag
        for placed in LIBRARY_FLAGS
        for flag in placed.flags
    },
    "ema": "--model_ema",
}
_KEYWORD = re.compile(
    r"(?<![\w.\-])("
    + "|".join(sorted(KEYWORD_FLAGS, key=len, reverse=True))
    + r")=(?:'([^']*)'|\"([^\"]*)\"|([\w.]+))?"
)


def _flag(match: re.Match) -> str:
    flag = KEYWORD_FLAGS[match[1]]
    value = next((v for v in match.groups()[1:] if v is not None), None)
    return flag if value in (None, "True") else f"{flag} {value}"


# what a library message points to -> what the command line offers for it
PHRASES = {"accel.backends.support_matrix()": "launch_single_task --backends"}


def as_flags(message: str) -> str:
    """`message` with every `keyword=value` of prepare's written as the command line's flag."""
    for library, command_line in PHRASES.items():
        message = message.replace(library, command_line)
    return _KEYWORD.sub(_flag, message)
