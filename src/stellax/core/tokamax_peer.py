"""tokamax (Google's kernel library) as a peer that stellax's benchmarks run beside its own ops.

tokamax reads its configuration from absl flags, and the first read of one parses ``sys.argv`` when
no one has parsed the flags yet. Inside a program with its own options (``stellax bench``, a
benchmark script's ``--out``) that parse fails on the first tokamax call with absl's
``UnrecognizedFlagError`` ("Unknown command line flag 'out'"). `load` imports tokamax and, when the
flags are still unparsed, marks them parsed, so every flag keeps its default.
"""

from __future__ import annotations


def load():
    """The ``tokamax`` module, ready to call from a program with its own command line (module doc).

    Raises:
      ImportError: tokamax, or one of its dependencies, is not installed (``pip install tokamax``).
    """
    import tokamax
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax
