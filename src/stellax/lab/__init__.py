"""The kernel lab: an evaluation environment and an automated search for
candidate implementations of stellax ops (docs/lab.md)."""
