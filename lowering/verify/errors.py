"""What the verifier raises: `VerifyError`, which carries every problem it found."""

from __future__ import annotations


class VerifyError(ValueError):
    """The kernel breaks a rule of the IR; `diagnostics` holds every problem found."""

    def __init__(self, diagnostics):
        self.diagnostics = tuple(diagnostics)
        super().__init__("\n".join(d.message for d in self.diagnostics))

    def __reduce__(self):
        return (type(self), (self.diagnostics,))
