"""The lab's error type."""


class LabError(ValueError):
    """A problem the user can act on: an unknown op, a file that defines no
    implementation, an empty config space, an endpoint that refuses, ..."""
