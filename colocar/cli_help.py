"""The help layout of every `colocar` command: each option's default is shown (runs anywhere).

argparse's `ArgumentDefaultsHelpFormatter` appends "(default: X)"; this one skips options whose
help already states the default or that have none (None, False), which would read "None".
"""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in `--help`, descriptions (module docstrings) kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action) or text
