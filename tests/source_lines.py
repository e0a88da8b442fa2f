"""Find a test file's own lines by a trailing marker comment (for exact source-line messages)."""

import os


def line_of(path: str, marker: str) -> str:
    """"file.py:LINE" of the line in `path` that ends with the comment `# <marker>`."""
    with open(path) as source:
        for number, line in enumerate(source, 1):
            if line.rstrip().endswith(f"# {marker}"):
                return f"{os.path.basename(path)}:{number}"
    raise AssertionError(f"no line marked {marker} in {path}")
