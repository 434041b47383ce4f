"""Writes a benchmark's section into its markdown file, leaving the file's other sections."""

from __future__ import annotations

import os
import re


def write_section(path: str, section: str, begin: str, end: str, title: str) -> None:
    """Puts `section` (which starts with the marker `begin` and ends with `end`) into the
    markdown file `path`: in place of the section between those markers, or appended when
    there is none; a new file starts with the heading `# title`."""
    text = open(path).read() if os.path.exists(path) else f"# {title}\n"
    if begin in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: section, text,
                      flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    temporary = f"{path}.tmp-{os.getpid()}"  # a killed run leaves the previous file whole
    with open(temporary, "w") as f:
        f.write(text)
    os.replace(temporary, path)
