"""What the simulator raises: the user-facing errors of a kernel that runs wrong (each names the
CTA, role, warpgroup, statement and loop variables involved), and the internal error of a kernel
the simulator should never have been given."""

from __future__ import annotations


class SimulationError(RuntimeError):
    """The simulated kernel did something wrong (or was called wrongly)."""


class DeadlockError(SimulationError):
    """Every coroutine is blocked and nothing asynchronous is in flight (or max_steps ran out)."""


class RaceError(SimulationError):
    """A shared-memory region or register tile was accessed without the required ordering."""


class ProtocolError(SimulationError):
    """A rule of the execution model was broken at run time (barrier use, tx bytes, indices...)."""


class SimulatorInternalError(AssertionError):
    """The simulator met IR that breaks a structural rule. `simulate` verifies the structure
    first (`verify(kernel, contract=False)`), so this is a bug in the verifier or the simulator,
    not a message for the kernel's author."""


# Why a CTA of a cluster must know, before it exits, of what its peers do to it.
PRODUCER_TAIL = ("a peer may still arrive on or multicast into a CTA's smem after it exits; wait for those phases "
                 "before exiting (the producer's tail)")


def check_verified(condition: bool, rule: str) -> None:
    """An internal assert: `rule` is a structural rule the verifier already checked."""
    if not condition:
        raise SimulatorInternalError(f"the verifier should have rejected this kernel: {rule}")
